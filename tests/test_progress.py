"""A rank's progress from its lines (core/progress.py), tables with a fake clock: tqdm bars,
metric lines and the user's regex -> steps; samples -> rates; rates -> stragglers named
once per episode; the board that the job directory's sink feeds (streams/progressboard.py)."""

from __future__ import annotations

import re

import pytest

from launcher.base.errors import UsageError
from launcher.core.command import LaunchSpec
from launcher.core.config import compile_progress_regex
from launcher.core.hosts import Host
from launcher.core.outcome import RankState
from launcher.core.progress import (
    LOOK_AGAIN_S,
    MAX_COUNTERS,
    SAMPLE_EVERY_S,
    TAIL_LINES,
    Lagging,
    ProgressFigures,
    ProgressParser,
    ProgressStep,
    RankProgress,
    StragglerRule,
    describe_stragglers,
)
from launcher.streams.progressboard import ProgressBoard

BAR = "█▌"  # (tqdm's bar characters are UTF-8: the parser reads bytes)


@pytest.mark.parametrize(
    ("line", "step"),
    [
        (
            f"  45%|████{BAR}     | 45/100 [00:12<00:15,  3.61it/s]\r",
            ProgressStep(45, "tqdm/100", 3.61, 100),
        ),
        (
            f"Epoch 1:  45%|{BAR}| 45/100 [00:12<00:15,  3.61it/s, loss=0.52]",
            ProgressStep(45, "tqdm/100", 3.61, 100),
        ),
        ("  3%|▎         | 3/100 [00:07<03:52,  2.50s/it]", ProgressStep(3, "tqdm/100", 0.4, 100)),
        ("  0%|          | 0/100 [00:00<?, ?it/s]", ProgressStep(0, "tqdm/100", None, 100)),
        ("45it [00:12, 3.61it/s]", ProgressStep(45, "tqdm/?", 3.61, None)),
        (
            "train: 1.23k/10.0k [01:02<07:30, 19.5batch/s]",
            ProgressStep(1230, "tqdm/10.0k", 19.5, 1e4),
        ),
        ("12/50 [1:02:03<3:00:00, 1.02kit/s]", ProgressStep(12, "tqdm/50", 1020, 50)),
        (
            "100%|██████████| 100/100 [00:27<00:00,  3.62it/s]",
            ProgressStep(100, "tqdm/100", 3.62, 100),
        ),
        ("metric: step=120 loss=0.31", ProgressStep(120, "metric")),
        ("metric: loss=0.31, step=7", ProgressStep(7, "metric")),
        ("  metric: step=3\r", ProgressStep(3, "metric")),
        # not steps
        ("metric: loss=0.31", None),
        ("metric: step=abc", None),
        ("metric: step=-1", None),
        ("loading /srv/data/shard-3/ (45/100 files)", None),
        ("throughput 3.61 it/s", None),
        ("epoch 3 step 120", None),
        ("", None),
    ],
)
def test_a_line_gives_its_step(line: str, step: ProgressStep | None) -> None:
    found = ProgressParser().parse(line.encode())
    if step is not None and found is not None and step.printed_rate is not None:
        assert found.printed_rate == pytest.approx(step.printed_rate)
        found = ProgressStep(found.count, found.counter, step.printed_rate, found.total)
    assert found == step


@pytest.mark.parametrize(
    ("pattern", "line", "count"),
    [
        (r"step (\d+)", "epoch 3 step 120 loss 0.2", 120.0),
        (r"(epoch|it) (?P<step>\d+)", "it 45", 45.0),
        (r"iteration (\d+(?:\.\d+)?)", "iteration 7.0", 7.0),
        (r"step (\d+)", "45/100 [00:12<00:15,  3.61it/s]", None),  # it replaces the built-ins
        (r"step (\d+)", "metric: step=3", None),
        (r"step (\d*)", "step x", None),  # the group matched nothing that is a number
        (r"step (\d+)?", "step x", None),  # ...or did not take part
        (r"step=(\S+)", "step=inf", None),  # numbers to float(), but no step
        (r"step=(\S+)", "step=nan", None),
        (r"step=(\S+)", "step=1e999", None),
    ],
)
def test_the_users_regex_gives_its_group(pattern: str, line: str, count: float | None) -> None:
    parser = ProgressParser(compile_progress_regex(pattern))
    found = parser.parse(line.encode())
    assert found == (ProgressStep(count, "regex") if count is not None else None)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("step (", "--progress-regex 'step (': not a regular expression (missing ), unterminated"),
        (r"step \d+", r"--progress-regex 'step \d+' has no group: it needs one around the step"),
        (r"(\w+) (\d+)", r"--progress-regex '(\w+) (\d+)' has 2 groups: which is the step?"),
    ],
)
def test_a_bad_regex_is_one_line_naming_it(pattern: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        compile_progress_regex(pattern)
    assert caught.value.message.startswith(message)
    assert "--progress-regex" in (caught.value.hint or "")


def test_a_batch_gives_its_last_step_looking_only_at_its_tail() -> None:
    parser = ProgressParser()
    noise = [b"loss 0.3 on /srv/data"] * 10
    lines = [b"metric: step=1", *noise, b"metric: step=2", *noise]
    assert parser.last_step(lines) == ProgressStep(2, "metric")
    # a step further back than the tail is not looked for (the next batch will have one)
    assert parser.last_step([b"metric: step=1", *[b"x"] * TAIL_LINES]) is None
    assert parser.last_step([b"metric: step=9 " + b"x" * 5000]) is None  # no bar is that long
    assert parser.last_step([]) is None


@pytest.mark.parametrize(
    ("pattern", "count"),
    [
        (r"^step (\d+)$", 7.0),  # anchored at each line, in a batch as alone
        (r"\Astep (\d+)", 7.0),  # anchored at the text's start: tried line by line
        (r"step (\d+)", 7.0),
        (r"^loss (\d+)", None),
    ],
)
def test_the_users_regex_finds_the_last_step_of_a_batch(pattern: str, count: float | None) -> None:
    parser = ProgressParser(compile_progress_regex(pattern))
    lines = [b"warming up", b"step 3", b"data loaded", b"step 7", b"saving"]
    assert parser.last_step(lines) == (ProgressStep(count, "regex") if count else None)


def test_a_batch_with_huge_lines_is_looked_at_line_by_line() -> None:
    parser = ProgressParser()
    huge = b"x" * (1 << 20)
    assert parser.last_step([b"metric: step=4", huge, huge]) == ProgressStep(4, "metric")


def samples(
    progress: RankProgress, steps: list[tuple[float, float]], counter: str = "metric"
) -> None:
    for at, count in steps:
        progress.add(at, ProgressStep(count, counter))


@pytest.mark.parametrize(
    ("steps", "now", "rate"),
    [
        ([(0.0, 0)], 0.0, None),  # one sample: no rate (a metric line says none itself)
        ([(0.0, 0), (1.0, 20)], 1.0, 20.0),
        ([(t / 2, 10 * t) for t in range(11)], 5.0, 20.0),  # 20 steps/s, sampled twice a second
        # samples older than the window (10 s) fall out: the rate is the last 10 s's
        (
            [*[(t, 20.0 * t) for t in range(11)], *[(11.0 + t, 200 + 5 * t) for t in range(11)]],
            21.0,
            5.0,
        ),
        # the next epoch's counter starts at 0: the count goes on
        ([(0.0, 90), (1.0, 100), (2.0, 10)], 2.0, 10.0),
        ([(0.0, 5), (2.0, 5)], 2.0, 0.0),  # printed, not moving
        # nothing new for longer than a step and a sample take: it slows down as it waits
        ([(0.0, 0), (1.0, 10)], 1.5, 10.0),
        ([(0.0, 0), (1.0, 10)], 1.0 + 0.1 + SAMPLE_EVERY_S + 3.0, 10 / 4),
    ],
)
def test_the_rate_is_measured_from_the_steps(
    steps: list[tuple[float, float]], now: float, rate: float | None
) -> None:
    progress = RankProgress()
    samples(progress, steps)
    figures = progress.figures(now)
    assert figures is not None
    assert figures.rate == (None if rate is None else pytest.approx(rate))


def test_tqdms_printed_rate_stands_in_until_two_samples_came() -> None:
    progress = RankProgress()
    progress.add(0.0, ProgressStep(3, "tqdm/100", 2.5, 100))
    assert progress.figures(0.0) == ProgressFigures(3, 2.5)
    progress.add(1.0, ProgressStep(7, "tqdm/100", 2.5, 100))
    assert progress.figures(1.0) == ProgressFigures(7, 4.0)  # its own steps, not the print
    progress.add(2.0, ProgressStep(100, "tqdm/100", 2.5, 100))
    assert progress.figures(2.0) == ProgressFigures(100, None)  # a full bar: no rate


def test_of_nested_bars_the_inner_one_measures_the_rank() -> None:
    progress = RankProgress()
    for second in range(5):  # an epoch bar at 1 step/s, a batch bar at 50 steps/s
        progress.add(second, ProgressStep(second, "tqdm/10", None, 10))
        progress.add(second + 0.5, ProgressStep(50 * second + 25, "tqdm/500", None, 500))
    figures = progress.figures(4.5)
    assert figures is not None and figures.rate == pytest.approx(50.0)


def test_a_rank_keeps_few_counters() -> None:
    progress = RankProgress()
    for index in range(MAX_COUNTERS + 3):
        progress.add(float(index), ProgressStep(1, f"tqdm/{index + 2}", None, index + 2))
    assert len(progress.counters) == MAX_COUNTERS
    assert "tqdm/2" not in progress.counters  # the one heard of longest ago went


def test_a_rank_wants_a_sample_every_half_second() -> None:
    progress = RankProgress()
    assert progress.wants(0.0)
    progress.add(0.0, ProgressStep(1, "metric"))
    assert not progress.wants(SAMPLE_EVERY_S - 0.01)
    assert progress.wants(SAMPLE_EVERY_S)
    progress.missed(1.0)  # a batch without a step: not every batch after it is looked at
    assert not progress.wants(1.0 + LOOK_AGAIN_S - 0.01)
    assert progress.wants(1.0 + LOOK_AGAIN_S)


def steady(
    rates: dict[int, float], since: float, until: float, rule: StragglerRule
) -> list[tuple[float, Lagging]]:
    """The rule checked every half second from ``since`` to ``until`` at these rates."""
    named: list[tuple[float, Lagging]] = []
    now = since
    while now <= until + 1e-9:
        named.extend((now, lagging) for lagging in rule.check(rates, now))
        now += 0.5
    return named


def test_a_rank_below_the_line_for_long_enough_is_named_once() -> None:
    rule = StragglerRule(ratio=0.7, after_s=30)
    rates = {0: 20.0, 1: 20.0, 2: 11.0, 3: 21.0}
    named = steady(rates, 0.0, 120.0, rule)
    assert named == [(30.0, Lagging(2, 0.55, 30.0))]


@pytest.mark.parametrize(
    "rates",
    [
        {0: 20.0, 1: 19.0, 2: 15.0, 3: 21.0},  # 0.75x: above the line
        {0: 20.0, 1: 5.0},  # two ranks: which of them is odd?
        {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0},  # all stand still
        {0: 0.0, 1: 0.0, 2: 10.0},  # most stand still: the median is 0
        {},
    ],
)
def test_nobody_is_named(rates: dict[int, float]) -> None:
    assert steady(rates, 0.0, 100.0, StragglerRule(ratio=0.7, after_s=30)) == []


def test_an_episode_ends_when_the_rank_is_back_or_gone() -> None:
    rule = StragglerRule(ratio=0.7, after_s=10)
    slow = {0: 20.0, 1: 20.0, 2: 10.0}
    assert [n for _, n in steady(slow, 0.0, 20.0, rule)] == [Lagging(2, 0.5, 10.0)]
    # back to 0.8x: above the line, but not halfway back to the median: the same episode
    assert steady({0: 20.0, 1: 20.0, 2: 16.0}, 20.5, 40.0, rule) == []
    assert steady(slow, 40.5, 60.0, rule) == []
    # back to 0.9x: the episode is over; slow again for 10 s: named again
    assert steady({0: 20.0, 1: 20.0, 2: 18.0}, 60.5, 61.0, rule) == []
    assert [t for t, _ in steady(slow, 61.5, 80.0, rule)] == [71.5]
    # it exits (no rate): over too
    assert steady({0: 20.0, 1: 20.0, 3: 20.0}, 80.5, 81.0, rule) == []
    assert [t for t, _ in steady(slow, 81.5, 100.0, rule)] == [91.5]


def test_a_short_dip_is_not_named() -> None:
    rule = StragglerRule(ratio=0.7, after_s=10)
    assert steady({0: 20.0, 1: 20.0, 2: 10.0}, 0.0, 9.5, rule) == []
    assert steady({0: 20.0, 1: 20.0, 2: 15.0}, 10.0, 10.0, rule) == []  # back above the line
    assert [t for t, _ in steady({0: 20.0, 1: 20.0, 2: 10.0}, 10.5, 30.0, rule)] == [20.5]


def test_ranks_that_fall_behind_a_sample_apart_are_named_together() -> None:
    """A slow machine's ranks cross the line a sample or two apart: named in one check (one
    line for their host), not one check each; a rank that fell behind later waits its turn."""
    rule = StragglerRule(ratio=0.7, after_s=30)
    fast = {rank: 20.0 for rank in range(8)}
    assert steady(fast, 0.0, 10.0, rule) == []
    assert steady({**fast, 4: 10.0}, 10.5, 11.0, rule) == []
    assert steady({**fast, 4: 10.0, 5: 10.0}, 11.5, 20.0, rule) == []
    named = steady({**fast, 3: 10.0, 4: 10.0, 5: 10.0}, 20.5, 60.0, rule)
    assert named == [
        (40.5, Lagging(4, 0.5, 30.0)),
        (40.5, Lagging(5, 0.5, 29.0)),  # (a second short: named with rank 4)
        (50.5, Lagging(3, 0.5, 30.0)),
    ]


def test_the_notice_names_rank_and_host_one_line_per_host() -> None:
    hosts = {4: "node2", 5: "node2", 9: "node3", 1: "node1"}
    found = [
        Lagging(5, 0.554, 30.2), Lagging(4, 0.52, 31.0), Lagging(9, 0.31, 60.0),
        Lagging(1, 0.55, 30.0), Lagging(2, 0.6, 30.0),
    ]  # fmt: skip
    assert describe_stragglers(found, hosts) == [
        "dtrain: ranks 4-5 on node2 run at 0.52-0.55x the median step rate for 30 s",
        "dtrain: rank 9 on node3 runs at 0.31x the median step rate for 60 s",
        "dtrain: rank 1 on node1 runs at 0.55x the median step rate for 30 s",
        "dtrain: rank 2 on ? runs at 0.60x the median step rate for 30 s",
    ]


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(rank: int, host: str = "node1", label: str | None = None) -> LaunchSpec:
    return LaunchSpec(rank=rank, host=Host(host), local_rank=0, argv=("x",), env={}, label=label)


def test_the_board_takes_a_sample_per_rank_every_half_second() -> None:
    clock = FakeTime()
    board = ProgressBoard(ProgressParser(), clock)
    for tick in range(9):  # four times a second, 5 steps a tick
        clock.now = tick / 4
        board.observe(spec(0), [b"metric: step=%d" % (5 * tick)])
        board.observe(spec(1, "node2"), [b"nothing to see"])
        board.observe(spec(-1, label="mpirun"), [b"metric: step=1"])  # no rank's
    counter = board.ranks[0].counters["metric"]
    assert [at for at, _ in counter.samples] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert board.figures(2.0) == {0: ProgressFigures(40, 20.0)}
    assert board.rates(2.0) == {0: 20.0}
    assert board.host_of() == {0: "node1", 1: "node2"}


def test_an_ended_rank_has_no_rate_and_a_restarted_one_starts_anew() -> None:
    clock = FakeTime()
    board = ProgressBoard(ProgressParser(), clock)
    for tick in range(3):
        clock.now = float(tick)
        board.observe(spec(0), [b"metric: step=%d" % (10 * tick)])
    state = RankState(0, "node1", "worker", 42, 0.0)
    board.update(state)
    assert board.rates(2.0) == {0: 10.0}
    board.update(RankState(0, "node1", "worker", 42, 0.0, status=1))
    assert board.figures(2.0) == {0: ProgressFigures(20, None)} and board.rates(2.0) == {}
    board.update(RankState(0, "node1", "worker", 43, 3.0, restarts=1))
    assert board.figures(3.0) == {}  # the new run has printed nothing yet


class Broken(ProgressParser):
    def last_step(self, lines: object) -> ProgressStep | None:
        raise re.error("a bug")


def test_a_failing_board_turns_itself_off_and_the_lines_go_on() -> None:
    shown: list[list[bytes]] = []

    class Sink:
        def show(self, spec: LaunchSpec, stream: str, lines: list[bytes]) -> None:
            shown.append(lines)

        def update(self, state: RankState) -> None:
            pass

    board = ProgressBoard(Broken(), FakeTime())
    tapped = board.tap(Sink())
    tapped.show(spec(0), "stdout", [b"metric: step=1"])
    tapped.show(spec(0), "stdout", [b"metric: step=2"])
    assert shown == [[b"metric: step=1"], [b"metric: step=2"]] and board.broken
