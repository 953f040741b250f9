"""Collapsing identical lines across ranks: tables, and a property over random interleavings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.collapse import Collapsed, Collapser, expand, rank_set, same_text


def test_identical_lines_of_every_rank_come_out_once_at_once() -> None:
    c = Collapser(world_size=4)
    assert [c.add(r, "stderr", b"UserWarning: numpy", now=0.1) for r in range(3)] == [[], [], []]
    assert c.add(3, "stderr", b"UserWarning: numpy", now=0.2) == [
        Collapsed((0, 1, 2, 3), "stderr", b"UserWarning: numpy")
    ]


def test_a_line_of_some_ranks_comes_out_when_its_window_closes() -> None:
    c = Collapser(world_size=8, window_s=0.5)
    c.add(2, "stdout", b"loading", now=1.0)
    c.add(5, "stdout", b"loading", now=1.2)
    assert c.due(1.49) == []
    assert c.due(1.5) == [Collapsed((2, 5), "stdout", b"loading")]
    assert c.next_due() is None


def test_lines_that_differ_are_never_merged() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stdout", b"rank 0 loss 0.51", now=0)
    c.add(1, "stdout", b"rank 1 loss 0.49", now=0)
    c.add(1, "stderr", b"rank 0 loss 0.51", now=0)  # same text, other stream
    assert c.flush() == [
        Collapsed((0,), "stdout", b"rank 0 loss 0.51"),
        Collapsed((1,), "stdout", b"rank 1 loss 0.49"),
        Collapsed((1,), "stderr", b"rank 0 loss 0.51"),
    ]


def test_log_prefixes_differing_in_time_pid_or_thread_are_the_same_line() -> None:
    glog = [
        b"[W1123 08:38:17.186481407 socket.cpp:207] [c10d] The hostname cannot be retrieved.",
        b"[W1123 08:38:17.201337112 socket.cpp:207] [c10d] The hostname cannot be retrieved.",
    ]
    absl = [
        b"I0000 00:00:1795423122.942183   23605 port.cc:153] oneDNN custom operations are on.",
        b"I0000 00:00:1795423123.001200   23611 port.cc:153] oneDNN custom operations are on.",
    ]
    logging = [
        b"2026-11-23 08:38:17,186 WARNING slow step",
        b"2026-11-23 08:38:18,002 WARNING slow step",
    ]
    for pair in (glog, absl, logging):
        c = Collapser(world_size=2)
        c.add(0, "stderr", pair[0], now=0)
        assert c.add(1, "stderr", pair[1], now=0.1) == [Collapsed((0, 1), "stderr", pair[0])]
    other_file = (
        b"[W1123 08:38:17.186481407 socket.cpp:208] [c10d] The hostname cannot be retrieved."
    )
    assert same_text(other_file) != same_text(glog[0])  # file:line is not a varying part


def test_each_rank_keeps_its_order() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stdout", b"A", now=0)
    c.add(0, "stdout", b"B", now=0)
    c.add(1, "stdout", b"B", now=0)  # joins B
    c.add(1, "stdout", b"A", now=0)  # may not join A (before B): a group of its own
    assert c.flush() == [
        Collapsed((0,), "stdout", b"A"),
        Collapsed((0, 1), "stdout", b"B"),
        Collapsed((1,), "stdout", b"A"),
    ]


def test_rank_sets() -> None:
    assert rank_set([0, 1, 2, 3, 5]) == "0-3,5"
    assert rank_set([7]) == "7"
    assert rank_set([1, 3, 4, 9, 10, 11]) == "1,3-4,9-11"


WORDS = [
    b"warn",
    b"loss 1",
    b"loss 2",
    b"[W1123 08:38:17.1 a.cpp:1] x",
    b"[W1123 09:00:00.2 a.cpp:1] x",
]


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 5),
    events=st.lists(
        st.tuples(
            st.integers(0, 4),
            st.sampled_from(WORDS),
            st.sampled_from(["stdout", "stderr"]),
            st.floats(0, 0.4),
        ),
        max_size=60,
    ),
)
def test_expanding_gives_back_every_ranks_lines_in_order(
    world: int, events: list[tuple[int, bytes, str, float]]
) -> None:
    c = Collapser(world_size=world, window_s=0.5)
    now, out, sent = 0.0, [], {}
    for rank, text, stream, step in events:
        rank %= world
        now += step
        out += c.add(rank, stream, text, now)
        sent.setdefault(rank, []).append((stream, same_text(text)))
        due = c.next_due()
        assert due is None or due > now  # nothing overdue is held back
    out += c.flush()
    assert expand(out) == sent
