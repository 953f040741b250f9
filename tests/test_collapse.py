"""Collapsing identical lines across ranks: tables, and a property over random interleavings."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.core.command import LaunchSpec
from launcher.core.config import rank_set
from launcher.core.hosts import Host
from launcher.streams.collapse import (
    FLOOD_PASS_S,
    HOLD_MAX_S,
    HOLD_S,
    MAX_HELD,
    Collapsed,
    Collapser,
    expand,
)
from launcher.streams.outlets import Outlet
from launcher.streams.sametext import same_text
from launcher.view.lineviews import CollapsingView, JsonLinesView, LineView
from tests.conftest import py, run_dtrain
from tests.test_jobs import job_id_of


def test_identical_lines_of_every_rank_come_out_once_at_once() -> None:
    c = Collapser(world_size=4)
    assert [c.add(r, "stderr", b"UserWarning: numpy", now=0.1) for r in range(3)] == [[], [], []]
    assert c.add(3, "stderr", b"UserWarning: numpy", now=0.2) == [
        Collapsed((0, 1, 2, 3), "stderr", (b"UserWarning: numpy",))
    ]


def test_a_line_of_some_ranks_comes_out_when_its_window_closes() -> None:
    c = Collapser(world_size=8, window_s=0.5)
    c.add(2, "stdout", b"loading", now=1.0)
    c.add(5, "stdout", b"loading", now=1.2)
    for rank in (0, 1, 3, 4, 6, 7):  # the others said something else at that point instead
        c.add(rank, "stdout", b"skipping %d" % rank, now=1.1)
    assert c.due(1.49) == []
    assert c.due(1.5) == [Collapsed((2, 5), "stdout", (b"loading",))]


def feed(c: Collapser, arrivals: list[tuple[float, int, bytes]]) -> list[Collapsed]:
    """Each rank's line (stdout) at its time, the collapser ticked in between as the writer
    ticks it (whenever ``next_due`` comes before the next line)."""
    out: list[Collapsed] = []
    for at, rank, text in sorted(arrivals):
        while (due := c.next_due()) is not None and due <= at:
            out += c.due(due)
        out += c.add(rank, "stdout", text, at)
    while (due := c.next_due()) is not None:
        out += c.due(due)
    return out


WARNING = b"UserWarning: TypedStorage is deprecated"


def test_ranks_printing_a_line_50_ms_apart_under_load_collapse_into_one_group() -> None:
    # 50 ms apart, stretched by a busy machine: the last ranks' copies reach dtrain after the
    # first one's window (0.5 s) closed.  Before: [0-5] and [6-7].
    c = Collapser(world_size=8, window_s=0.5)
    out = feed(c, [(rank * 0.05 + (0.3 if rank >= 6 else 0), rank, WARNING) for rank in range(8)])
    assert out == [Collapsed(tuple(range(8)), "stdout", (WARNING,))]


def test_ranks_printing_a_line_300_ms_apart_collapse_into_one_group() -> None:
    c = Collapser(world_size=8, window_s=0.5)
    out = feed(c, [(rank * 0.3, rank, WARNING) for rank in range(8)])
    assert out == [Collapsed(tuple(range(8)), "stdout", (WARNING,))]
    c = Collapser(world_size=8, window_s=0.5)
    assert c.add(0, "stdout", WARNING, now=0) == []
    assert c.add(1, "stdout", WARNING, now=0.3) == []
    assert c.due(2.0) == []  # the others have not printed a line yet: expected
    assert c.add(2, "stdout", WARNING, now=2.2) == []  # within 2 s of the latest: joins
    assert c.next_due() == 2.2 + HOLD_S


def test_a_shared_line_waits_for_the_others_at_most_the_bound() -> None:
    c = Collapser(world_size=8, window_s=0.5)
    c.add(0, "stdout", WARNING, now=0)
    c.add(1, "stdout", WARNING, now=0.1)
    c.add(0, "stdout", b"rank 0 goes on", now=0.2)
    assert c.due(0.1 + HOLD_S - 0.01) == []
    assert c.next_due() == 0.1 + HOLD_S
    assert c.due(0.1 + HOLD_S) == [
        Collapsed((0, 1), "stdout", (WARNING,)),
        Collapsed((0,), "stdout", (b"rank 0 goes on",)),
    ]
    # then ranks joining every 1.5 s: held no longer than HOLD_MAX_S after the first said it
    times = [0.0, *(0.1 + 1.5 * (rank - 1) for rank in range(1, 10))]
    out = feed(Collapser(world_size=10), [(at, rank, WARNING) for rank, at in enumerate(times)])
    late = [rank for rank, at in enumerate(times) if at >= HOLD_MAX_S]  # then each alone
    assert late == [8, 9]
    assert out == [
        Collapsed(tuple(range(8)), "stdout", (WARNING,)),
        *(Collapsed((rank,), "stdout", (WARNING,)) for rank in late),
    ]


def test_a_lone_line_waits_only_its_window() -> None:
    c = Collapser(world_size=8, window_s=0.5)
    c.add(0, "stdout", b"rank 0 says this alone", now=0)
    assert c.due(0.5) == [Collapsed((0,), "stdout", (b"rank 0 says this alone",))]


def test_groups_come_out_in_time_order() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stdout", b"saved checkpoint", now=1.0)
    c.add(1, "stdout", b"rank 1: step 10", now=1.3)
    c.add(1, "stdout", b"saved checkpoint", now=1.4)  # its own line goes in front
    out = c.flush()
    assert out == [
        Collapsed((1,), "stdout", (b"rank 1: step 10",)),
        Collapsed((0, 1), "stdout", (b"saved checkpoint",)),
    ]
    assert [item.time for item in out] == [1.3, 1.3]  # never earlier than what came before


def test_lines_that_differ_are_never_merged() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stdout", b"rank 0 loss 0.51", now=0)
    c.add(1, "stdout", b"rank 1 loss 0.49", now=0)
    c.add(1, "stderr", b"rank 0 loss 0.51", now=0)  # same text, other stream
    assert c.flush() == [
        Collapsed((0,), "stdout", (b"rank 0 loss 0.51",)),
        Collapsed((1,), "stdout", (b"rank 1 loss 0.49",)),
        Collapsed((1,), "stderr", (b"rank 0 loss 0.51",)),
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
        assert c.add(1, "stderr", pair[1], now=0.1) == [Collapsed((0, 1), "stderr", (pair[0],))]
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
        Collapsed((0,), "stdout", (b"A",)),
        Collapsed((0, 1), "stdout", (b"B",)),
        Collapsed((1,), "stdout", (b"A",)),
    ]


def test_a_shared_line_after_lines_of_each_rank_s_own_still_collapses() -> None:
    c = Collapser(world_size=4)
    out = []
    for rank in range(4):
        out += c.add_lines(rank, "stdout", [b"rank %d loss" % rank, b"epoch done"], 0.01 * rank)
    out += c.flush()
    assert out == [
        Collapsed((0,), "stdout", (b"rank 0 loss",)),
        Collapsed((1,), "stdout", (b"rank 1 loss",)),
        Collapsed((2,), "stdout", (b"rank 2 loss",)),
        Collapsed((3,), "stdout", (b"rank 3 loss",)),
        Collapsed((0, 1, 2, 3), "stdout", (b"epoch done",)),
    ]


def test_a_rank_s_own_lines_move_in_front_of_a_line_it_shares_later() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stdout", b"saved checkpoint", now=0)
    c.add_lines(1, "stdout", [b"rank 1: 1250 samples", b"rank 1: step 10"], now=0.1)
    c.add(1, "stdout", b"saved checkpoint", now=0.2)  # joins: its own lines go in front
    assert c.flush() == [
        Collapsed((1,), "stdout", (b"rank 1: 1250 samples", b"rank 1: step 10")),
        Collapsed((0, 1), "stdout", (b"saved checkpoint",)),
    ]


def test_lines_on_the_other_stream_do_not_keep_a_line_from_collapsing() -> None:
    c = Collapser(world_size=2)
    c.add(0, "stderr", b"WARN x", now=0)
    c.add(1, "stdout", b"hello 1", now=0)
    assert c.add(1, "stderr", b"WARN x", now=0) == [Collapsed((0, 1), "stderr", (b"WARN x",))]


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


def by_stream(lines: dict[int, list[tuple[str, bytes]]]) -> dict[tuple[int, str], list[bytes]]:
    """Each rank's lines on each stream, in order: what collapsing keeps (a rank's stdout
    and stderr are two pipes; no order between them is known)."""
    found: dict[tuple[int, str], list[bytes]] = {}
    for rank, items in lines.items():
        for stream, text in items:
            found.setdefault((rank, stream), []).append(text)
    return found


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
    now, out = 0.0, []
    sent: dict[int, list[tuple[str, bytes]]] = {}
    for rank, text, stream, step in events:
        rank %= world
        now += step
        out += c.add(rank, stream, text, now)
        sent.setdefault(rank, []).append((stream, same_text(text)))
        due = c.next_due()
        assert due is None or due > now  # nothing overdue is held back
    out += c.flush()
    assert by_stream(expand(out)) == by_stream(sent)


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 4),
    batches=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.lists(st.sampled_from(WORDS), min_size=1, max_size=6),
            st.sampled_from(["stdout", "stderr"]),
            st.floats(0, 0.4),
        ),
        max_size=30,
    ),
)
def test_batches_expand_back_to_every_ranks_lines_in_order(
    world: int, batches: list[tuple[int, list[bytes], str, float]]
) -> None:
    c = Collapser(world_size=world, window_s=0.5)
    now, out = 0.0, []
    sent: dict[int, list[tuple[str, bytes]]] = {}
    for rank, lines, stream, step in batches:
        rank %= world
        now += step
        out += c.add_lines(rank, stream, lines, now)
        sent.setdefault(rank, []).extend((stream, same_text(t)) for t in lines)
    out += c.flush()
    assert by_stream(expand(out)) == by_stream(sent)


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 6),
    batches=st.lists(
        st.tuples(
            st.integers(0, 5),
            st.lists(st.sampled_from(WORDS), min_size=1, max_size=4),
            st.sampled_from(["stdout", "stderr"]),
            st.floats(0, 1.5),
            st.booleans(),
        ),
        max_size=40,
    ),
)
def test_held_lines_keep_every_ranks_order_and_come_out_in_time_order(
    world: int, batches: list[tuple[int, list[bytes], str, float, bool]]
) -> None:
    """Lines held for ranks still expected to say them (seconds apart), ticked as the writer
    ticks: each rank's lines in order, times never going back, nothing overdue held."""
    c = Collapser(world_size=world, window_s=0.5)
    now, out = 0.0, []
    sent: dict[int, list[tuple[str, bytes]]] = {}
    for rank, lines, stream, step, tick in batches:
        rank %= world
        now += step
        due = c.next_due()
        if tick and due is not None and due <= now:
            out += c.due(due)
        out += c.add_lines(rank, stream, lines, now)
        sent.setdefault(rank, []).extend((stream, same_text(t)) for t in lines)
        due = c.next_due()
        assert due is None or due > now
    out += c.flush()
    assert by_stream(expand(out)) == by_stream(sent)
    times = [item.time for item in out]
    assert times == sorted(times)


class Joined(list[bytes]):
    """A batch that has its lines' bytes joined too, as batches from a pipe do."""

    @property
    def data(self) -> bytes:
        return b"\n".join(self)


def common_line(rank: int, i: int) -> bytes:
    """Line i that every rank says; every tenth with a log prefix whose time is the rank's."""
    if i % 10 == 3:
        return b"[W1123 08:38:1%d.186 a.cpp:7] step %d" % (rank, i)
    return b"step %d" % i


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(2, 5),
    script=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 9), st.booleans(), st.floats(0, 0.004)),
        max_size=80,
    ),
    small=st.booleans(),
)
def test_the_same_lines_cut_into_batches_anywhere_come_out_once_for_every_rank(
    world: int, script: list[tuple[int, int, bool, float]], small: bool
) -> None:
    """Every rank says the same lines (now and then one of its own between them), each in
    batches cut at its own places, all within one window: runs of them join runs of other
    ranks' batches however the cuts fall, so each comes out once for every rank (unless
    few lines may be held: then some come out early) and everything expands back.  Batches
    whose bytes come joined (matched as bytes) give exactly what lists of lines give."""
    out, sent = say_common_lines(world, script, small, list)
    assert by_stream(expand(out)) == by_stream(sent)
    assert all(item.ranks == tuple(sorted(set(item.ranks))) for item in out)
    if not small:
        common = [item for item in out if b" note " not in item.lines[0]]
        texts = [same_text(line) for item in common for line in item.lines]
        assert texts == [same_text(common_line(0, i)) for i in range(120)]
        assert all(item.ranks == tuple(range(world)) for item in common)
    joined, _ = say_common_lines(world, script, small, Joined)
    assert [(i.ranks, i.lines, i.time) for i in joined] == [(i.ranks, i.lines, i.time) for i in out]


def say_common_lines(
    world: int,
    script: list[tuple[int, int, bool, float]],
    small: bool,
    batch_of: Callable[[list[bytes]], list[bytes]],
) -> tuple[list[Collapsed], dict[int, list[tuple[str, bytes]]]]:
    c = Collapser(world_size=world, window_s=0.5, max_held=12 if small else MAX_HELD)
    said, now, out = [0] * world, 0.0, []
    sent: dict[int, list[tuple[str, bytes]]] = {}

    def say(rank: int, lines: list[bytes]) -> None:
        nonlocal out
        out += c.add_lines(rank, "stdout", batch_of(lines), now)
        sent.setdefault(rank, []).extend(("stdout", same_text(line)) for line in lines)
        for block in c.pending:  # runs: ascending, inside the block, neighbours unalike
            assert block.starts[0] == 0 and block.starts == sorted(set(block.starts))
            assert block.starts[-1] < len(block.lines)
            assert all(a != b for a, b in zip(block.saids, block.saids[1:], strict=False))
            assert all(block.rank in s and list(s) == sorted(set(s)) for s in block.saids)

    for rank, size, own, step in script:
        rank %= world
        now += step
        batch = [common_line(rank, i) for i in range(said[rank], min(120, said[rank] + size))]
        said[rank] += len(batch)
        if own:
            batch.insert(len(batch) // 2, b"rank %d note %d" % (rank, said[rank]))
        if batch:
            say(rank, batch)
    for rank in range(world):
        say(rank, [common_line(rank, i) for i in range(said[rank], 120)])
    return out + c.flush(), sent


def test_ranks_far_apart_in_a_flood_of_the_same_lines_still_collapse_it() -> None:
    """Ranks started apart print the same lines tens of thousands of lines apart at full
    speed (60-65 k at 1 M lines/s on 2 busy cores): up to MAX_HELD lines wait for the rank
    behind; a flood that nothing shares passes after FLOOD_LINES still."""
    lines = [b"step %d" % i for i in range(70_000)]
    c = Collapser(world_size=2)
    out = []
    for rank in (0, 1):
        for start in range(0, len(lines), 5_000):
            out += c.add_lines(rank, "stdout", lines[start : start + 5_000], now=rank * 0.1)
    assert merged(out + c.flush()) == [Collapsed((0, 1), "stdout", tuple(lines))]
    c = Collapser(world_size=2)
    for start in range(0, 30_000, 5_000):
        for rank in (0, 1):
            c.add_lines(rank, "stdout", distinct(rank, start, 5_000), now=0)
    assert c.passing_until is not None and c.held == 0


def test_a_batch_matched_as_bytes_joins_only_whole_lines_alike() -> None:
    c = Collapser(world_size=3)
    c.add_lines(0, "stdout", [b"step 1", b"step 2"], now=0)
    out = c.add_lines(1, "stdout", Joined([b"step 1", b"step 23"]), now=0.1) + c.flush()
    assert out == [
        Collapsed((0, 1), "stdout", (b"step 1",)),
        Collapsed((0,), "stdout", (b"step 2",)),
        Collapsed((1,), "stdout", (b"step 23",)),
    ]


def test_batches_of_the_same_lines_collapse_a_run_at_a_time() -> None:
    c = Collapser(world_size=3)
    lines = [b"epoch %d" % i for i in range(5)]
    out = c.add_lines(0, "stdout", lines, now=0) + c.add_lines(1, "stdout", lines[:3], now=0.1)
    assert out == []
    out = c.add_lines(2, "stdout", lines, now=0.1)  # every rank said the first three: out
    assert out == [Collapsed((0, 1, 2), "stdout", tuple(lines[:3]))]
    assert c.add_lines(1, "stdout", lines[3:], now=0.2) == [
        Collapsed((0, 1, 2), "stdout", tuple(lines[3:]))
    ]
    assert c.held == 0


def test_a_flood_is_let_out_early_so_memory_stays_bounded() -> None:
    c = Collapser(world_size=2, window_s=60)
    shown = 0
    for i in range(40):
        batch = [b"rank 0 line %d-%d" % (i, j) for j in range(10_000)]
        shown += sum(len(item.lines) for item in c.add_lines(0, "stdout", batch, now=i * 0.01))
        assert c.held <= MAX_HELD
    assert shown >= 40 * 10_000 - MAX_HELD  # well before any window closed


def test_a_flood_lets_go_of_the_lines_it_let_out() -> None:
    c = Collapser(world_size=2, window_s=60)
    for i in range(40):  # one rank alone: it may be ahead of the other, so it is held
        c.add_lines(0, "stdout", [b"rank 0 line %d-%d" % (i, j) for j in range(10_000)], i * 0.01)
    kept = sum(len(block.lines) for track in c.tracks.values() for block in track.free)
    assert kept <= MAX_HELD + 10_000  # what is held and one batch: not all 400,000 lines


def test_distinct_batches_then_a_shared_line_still_collapses() -> None:
    c = Collapser(world_size=3)
    own = {rank: [b"rank %d step %d" % (rank, i) for i in range(50)] for rank in range(3)}
    out = []
    for rank in range(3):
        out += c.add_lines(rank, "stdout", own[rank], now=0)
    for rank in range(3):
        out += c.add(rank, "stdout", b"epoch 1 done", now=0.1)
    assert out == []  # every rank said it, but it comes after lines that wait for the window
    assert c.due(0.5) == [
        Collapsed((0,), "stdout", tuple(own[0])),
        Collapsed((1,), "stdout", tuple(own[1])),
        Collapsed((2,), "stdout", tuple(own[2])),
        Collapsed((0, 1, 2), "stdout", (b"epoch 1 done",)),
    ]


def test_a_batch_that_starts_distinct_and_later_shares_lines_collapses_those() -> None:
    c = Collapser(world_size=2)
    shared = [b"warning: slow disk", b"warning: low memory"]
    c.add_lines(0, "stdout", [b"rank 0 a", b"rank 0 b", *shared], now=0)
    out = c.add_lines(1, "stdout", [b"rank 1 a", *shared, b"rank 1 z"], now=0.1) + c.flush()
    assert out == [
        Collapsed((0,), "stdout", (b"rank 0 a", b"rank 0 b")),
        Collapsed((1,), "stdout", (b"rank 1 a",)),
        Collapsed((0, 1), "stdout", tuple(shared)),
        Collapsed((1,), "stdout", (b"rank 1 z",)),
    ]


def distinct(rank: int, start: int, count: int) -> list[bytes]:
    return [b"rank %d line %d" % (rank, i) for i in range(start, start + count)]


def test_a_flood_that_nothing_shares_goes_straight_out() -> None:
    c = Collapser(world_size=2, window_s=0.5, max_held=10)
    out = c.add_lines(0, "stdout", distinct(0, 0, 6), now=0)
    out += c.add_lines(1, "stdout", distinct(1, 0, 6), now=0.01)  # 12 held: nothing shared
    assert out == [
        Collapsed((0,), "stdout", tuple(distinct(0, 0, 6))),
        Collapsed((1,), "stdout", tuple(distinct(1, 0, 6))),
    ]
    assert c.held == 0 and c.next_due() is None
    # from now on nothing is held, nor looked up: not even a line that another rank said
    assert c.add(0, "stdout", b"warn", now=0.02) == [Collapsed((0,), "stdout", (b"warn",))]
    assert c.add(1, "stdout", b"warn", now=0.03) == [Collapsed((1,), "stdout", (b"warn",))]


def test_a_flood_that_shares_lines_is_held_and_collapses() -> None:
    c = Collapser(world_size=2, window_s=0.5, max_held=20)
    out = []
    for start in range(0, 200, 8):  # rank 1 four lines behind: each of its lines joins
        behind = max(0, start - 4)
        out += c.add_lines(0, "stdout", distinct(9, start, 8), now=start * 0.001)
        out += c.add_lines(1, "stdout", distinct(9, behind, start + 4 - behind), start * 0.001)
        assert c.held <= 8
    out += c.add_lines(1, "stdout", distinct(9, 196, 4), now=0.2)
    assert merged(out) == [Collapsed((0, 1), "stdout", tuple(distinct(9, 0, 200)))]
    assert c.passing_until is None


def merged(items: list[Collapsed]) -> list[Collapsed]:
    """Neighbouring items of the same ranks and stream as one (as the view shows them)."""
    out: list[Collapsed] = []
    for item in items:
        if out and (out[-1].ranks, out[-1].stream) == (item.ranks, item.stream):
            item = Collapsed(item.ranks, item.stream, out.pop().lines + item.lines)
        out.append(item)
    return out


def test_a_flood_of_lines_said_too_long_ago_to_join_is_not_passed() -> None:
    c = Collapser(world_size=3, window_s=0.5, max_held=10)
    out = c.add_lines(0, "stdout", distinct(9, 0, 12), now=0)  # a flood of rank 0 alone
    assert out == [Collapsed((0,), "stdout", tuple(distinct(9, 0, 12)))]  # early, not passed
    out = c.add_lines(1, "stdout", distinct(9, 0, 12), now=0.01)  # too late to join, but shared
    assert out == [Collapsed((1,), "stdout", tuple(distinct(9, 0, 12)))]
    assert c.add_lines(2, "stdout", distinct(2, 0, 5), now=0.02) == []  # still held
    assert c.passing_until is None


def test_passing_ends_when_a_window_brings_few_lines() -> None:
    c = Collapser(world_size=2, window_s=0.5, max_held=10)
    c.add_lines(0, "stdout", distinct(0, 0, 6), now=0)
    c.add_lines(1, "stdout", distinct(1, 0, 6), now=0)  # passing from here
    assert c.add_lines(0, "stdout", distinct(0, 6, 3), now=0.1) != []
    assert c.add(0, "stdout", b"epoch done", now=0.6) == []  # 3 lines in that window: held
    assert c.add(1, "stdout", b"epoch done", now=0.7) == [
        Collapsed((0, 1), "stdout", (b"epoch done",))
    ]


def test_passing_ends_after_a_while_even_in_a_flood() -> None:
    c = Collapser(world_size=2, window_s=0.5, max_held=10)
    c.add_lines(0, "stdout", distinct(0, 0, 6), now=0)
    c.add_lines(1, "stdout", distinct(1, 0, 6), now=0)  # passing from here
    now = 0.0
    while now < FLOOD_PASS_S - 0.1:  # a flood: 24 lines a window
        now += 0.1
        assert c.add_lines(0, "stdout", distinct(0, 0, 6), now) != []
        assert c.add_lines(1, "stdout", distinct(1, 0, 6), now) != []
    now = FLOOD_PASS_S
    shared = distinct(9, 0, 3)
    assert c.add_lines(0, "stdout", shared, now) == []  # a new look: held
    assert c.add_lines(1, "stdout", shared, now) == [Collapsed((0, 1), "stdout", tuple(shared))]


FLOOD_WORDS = [*WORDS, b"only %d", b"only %d again"]


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 4),
    max_held=st.integers(1, 12),
    batches=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.lists(st.sampled_from(FLOOD_WORDS), min_size=1, max_size=8),
            st.sampled_from(["stdout", "stderr"]),
            st.floats(0, 0.4),
        ),
        max_size=40,
    ),
)
def test_floods_passing_and_collapsing_again_keep_every_ranks_lines_in_order(
    world: int, max_held: int, batches: list[tuple[int, list[bytes], str, float]]
) -> None:
    c = Collapser(world_size=world, window_s=0.5, max_held=max_held)
    now, out = 0.0, []
    sent: dict[int, list[tuple[str, bytes]]] = {}
    for rank, words, stream, step in batches:
        rank %= world
        now += step
        lines = [w % rank if b"%d" in w else w for w in words]  # some lines are the rank's own
        out += c.add_lines(rank, stream, lines, now)
        sent.setdefault(rank, []).extend((stream, same_text(t)) for t in lines)
        assert c.held <= max_held
        due = c.next_due()
        assert due is None or due > now  # nothing overdue is held back
    out += c.flush()
    assert by_stream(expand(out)) == by_stream(sent)


# The collapsing view in the job's output path: tags, JSON, the writer thread's ticks.


def spec_of(rank: int, host: str = "localhost") -> LaunchSpec:
    return LaunchSpec(rank, Host(host), rank % 2, ("true",), {}, node_rank=rank // 2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_view_tags_a_collapsed_line_with_its_rank_and_host_sets() -> None:
    out = io.StringIO()
    clock = Clock()
    view = CollapsingView(LineView(out, out, tag_format="[{rank}@{host}]"), 4, 0.5, clock)
    for rank in range(4):
        view.show(spec_of(rank, f"node{rank // 2 + 1}"), "stdout", [b"same", f"r{rank}".encode()])
    assert out.getvalue() == "[0-3@node1,node2] same\n"  # every rank said it: out at once
    clock.now = 0.6
    view.tick()
    assert out.getvalue().splitlines()[1:] == [
        "[0@node1] r0",
        "[1@node1] r1",
        "[2@node2] r2",
        "[3@node2] r3",
    ]


def test_other_tag_fields_become_sets_too() -> None:
    out = io.StringIO()
    clock = Clock()
    tag = "[{role}{task} {local_rank}/{node_rank}]"
    view = CollapsingView(LineView(out, out, tag_format=tag), 3, 0.5, clock)
    for rank in range(3):
        view.show(replace(spec_of(rank), task=rank), "stderr", [b"W"])
    assert out.getvalue() == "[worker0-2 0-1/0-1]<stderr> W\n"


def test_json_lines_carry_the_ranks_list() -> None:
    out = io.StringIO()
    clock = Clock()
    view = CollapsingView(JsonLinesView(out, clock=lambda: 5.0), 2, 0.5, clock)
    view.show(spec_of(0), "stdout", [b"hi"])
    view.show(spec_of(1), "stdout", [b"hi"])
    view.show(spec_of(1), "stdout", [b"only one"])
    view.flush()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["ranks"], r["rank"], r["text"]) for r in records] == [
        ([0, 1], 0, "hi"),
        ([1], 1, "only one"),
    ]


def test_the_writer_thread_lets_a_lone_line_out_when_its_window_closes() -> None:
    out = io.StringIO()
    view = CollapsingView(LineView(out, out), 4, 0.2)
    outlet = Outlet(view)
    outlet.queue.put_lines(spec_of(2), "stdout", [b"only rank 2 says this"])
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)  # no other line comes: the tick alone lets it out
    assert out.getvalue() == "[2] only rank 2 says this\n"
    outlet.queue.put_lines(spec_of(1), "stdout", [b"held at the end"])
    assert outlet.finish(timeout_s=10)  # the queue closes: the view is flushed
    assert out.getvalue().endswith("[1] held at the end\n")


def test_mpiruns_own_lines_are_not_held() -> None:
    out = io.StringIO()
    view = CollapsingView(LineView(out, out), 4, 0.5, Clock())
    view.show(replace(spec_of(0), label="mpirun"), "stderr", [b"daemon died"])
    assert out.getvalue() == "[mpirun]<stderr> daemon died\n"


def test_dtrain_logs_collapse_reads_a_finished_jobs_logs(mark: str, tmp_path: Path) -> None:
    code = (
        "import os, sys, time\n"
        "room = sys.argv[1]; rank = os.environ['RANK']\n"
        "open(os.path.join(room, rank), 'w').close()\n"
        "while len(os.listdir(room)) < 4: time.sleep(0.01)\n"
        "print('loading the dataset', flush=True); print('rank', rank, flush=True)\n"
    )
    job = run_dtrain("run", "-np", "4", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), str(tmp_path))
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("loading the dataset") == 4  # a pipe: every rank's line
    job_id = job_id_of(job.stderr)
    shown = run_dtrain("logs", job_id, "--collapse", "--collapse-window", "5")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines.count("[0-3] loading the dataset") == 1
    assert sorted(ln for ln in lines if " rank " in ln) == [f"[{r}] rank {r}" for r in range(4)]
    as_json = run_dtrain("logs", job_id, "--collapse", "--collapse-window", "5", "--json")
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["ranks"] for r in records if r["text"] == "loading the dataset"] == [[0, 1, 2, 3]]


def test_a_group_of_several_roles_tags_each_role_with_its_own_tasks() -> None:
    out = io.StringIO()
    clock = Clock()
    view = CollapsingView(LineView(out, out, tag_format="[{role}{task}]"), 4, 0.5, clock)
    roles = [("worker", 0), ("worker", 1), ("worker", 2), ("ps", 0)]
    for rank, (role, task) in enumerate(roles):
        view.show(replace(spec_of(rank), role=role, task=task), "stderr", [b"W"])
    assert out.getvalue() == "[worker0-2,ps0]<stderr> W\n"
