"""Each rank's progress from its output (pure): a line -> a step, steps -> a rate, rates ->
the stragglers to name.

A rank says how far it is in one of three ways: a tqdm progress bar
(``  45%|████▌     | 45/100 [00:12<00:15,  3.61it/s]``, redrawn in place with ``\\r``), a
``metric:`` line with a ``step`` (the sweep's format: ``metric: step=120 loss=0.3``), or a
line that the user's ``--progress-regex`` matches (its one group, or its group named
``step``, is the step; it then replaces the other two).  ``ProgressParser.last_step`` finds
the last such line of a batch of a rank's lines.  The launcher hands it batches of every
rank at up to millions of lines a second, so it looks only at a batch's last
``TAIL_LINES`` lines, passes over a batch that a byte test in C finds no step in (one
join, no loop in Python), and looks only when the rank's ``RankProgress`` wants a sample
(one per ``SAMPLE_EVERY_S``; ``LOOK_AGAIN_S`` after a batch without one): a step line
printed every few lines is seen, however fast the output.

``RankProgress`` keeps (time, count) samples of each counter a rank prints (two tqdm bars
nest: an epoch's and a batch's) and measures its rate from them, over the last
``RATE_WINDOW_S``: steps done over the time they took, not tqdm's printed rate (that is
the fallback until two samples came).  A counter that starts again (the next epoch's bar)
goes on counting from where it was.  ``StragglerRule`` compares the ranks' rates with
their median and says who stayed below ``ratio`` times it for ``after_s``: once per
episode.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from launcher.core.config import STEP_GROUP, rank_set
from launcher.core.options import DEFAULT_STRAGGLER_AFTER_S, DEFAULT_STRAGGLER_RATIO

SAMPLE_EVERY_S = 0.5  # a rank's step is taken at most this often
LOOK_AGAIN_S = 0.05  # a batch without a step: the rank's next batches are looked at after this
RATE_WINDOW_S = 10.0  # a rate is measured over the samples of this long
TAIL_LINES = 64  # of a batch of lines, the last ones looked at
MAX_PROGRESS_LINE = 4096  # a longer line is no progress bar (not searched)
MAX_COUNTERS = 4  # counters kept per rank (nested bars, a validation bar...)
MIN_RANKS = 3  # fewer ranks with a rate: no median to tell a slow one by
JOIN_S = 2 * SAMPLE_EVERY_S  # ranks this close behind one that is named are named with it

SI = {b"": 1.0, b"k": 1e3, b"M": 1e6, b"G": 1e9, b"T": 1e12, b"P": 1e15}
NUMBER = rb"\d+(?:\.\d+)?[kMGTP]?"  # tqdm's counts and rates, unit_scale's 1.23k included
# n/total [elapsed<remaining, rate] or n unit [elapsed, rate]; the rate is N unit/s,
# N s/unit (below one a second) or ? (not known yet).
TQDM = (
    rb"(?P<n>" + NUMBER + rb")(?:/(?P<total>" + NUMBER + rb"|\?)|[A-Za-z]*) ?"
    rb"\[[\d:]+(?:<[\d:?]+)?, *"
    rb"(?:(?P<rate>" + NUMBER + rb")[^\s,\]/]*/s|(?P<inverse>" + NUMBER + rb")s/|\?)"
)


@dataclass(frozen=True)
class ProgressStep:
    """One step a rank printed: its count, the counter it belongs to, and the rate the
    line itself says (tqdm's) and the total (tqdm's bar), where it says them."""

    count: float
    counter: str
    printed_rate: float | None = None
    total: float | None = None


def scaled(text: bytes) -> float:
    """tqdm's ``1.23k`` -> 1230.0."""
    if text[-1:].isalpha():
        return float(text[:-1]) * SI[text[-1:]]
    return float(text)


@functools.cache
def tqdm_bar() -> re.Pattern[bytes]:
    """``TQDM``, compiled by the first line that may be a bar (about 1 ms)."""
    return re.compile(TQDM)


def parse_tqdm(line: bytes) -> ProgressStep | None:
    """A tqdm bar's step, its total and its rate."""
    found = tqdm_bar().search(line)
    if found is None:
        return None
    total = found["total"]
    rate: float | None = None
    if found["rate"] is not None:
        rate = scaled(found["rate"])
    elif found["inverse"] is not None:
        seconds = scaled(found["inverse"])
        rate = 1 / seconds if seconds > 0 else None
    known = total is not None and total != b"?"
    return ProgressStep(
        scaled(found["n"]),
        "tqdm/" + (total.decode() if known else "?"),  # (a bar of another length: another)
        rate,
        scaled(total) if known else None,
    )


def parse_metric_step(line: bytes) -> ProgressStep | None:
    """``metric: step=120 loss=0.3`` -> step 120 (the sweep's parser reads the line)."""
    from launcher.core.sweep import parse_metric_line  # (when a job prints one: sweep's imports)

    value = parse_metric_line(line.decode("utf-8", "replace")).get(STEP_GROUP)
    if isinstance(value, float) and value >= 0:
        return ProgressStep(value, "metric")
    return None


class ProgressParser:
    """Lines of a rank -> its last step: tqdm bars and ``metric:`` lines, or only what
    the user's pattern matches."""

    def __init__(self, pattern: re.Pattern[bytes] | None = None) -> None:
        self.pattern = pattern
        self.group: int | str = STEP_GROUP if pattern and STEP_GROUP in pattern.groupindex else 1
        # The user's pattern over a batch's joined lines: ^ and $ at each line's ends (a line
        # it matches, it matches there too); one anchored to the text's ends is tried per line.
        anchored = pattern is not None and (b"\\A" in pattern.pattern or b"\\Z" in pattern.pattern)
        self.joined = (
            None
            if pattern is None or anchored
            else re.compile(pattern.pattern, pattern.flags | re.MULTILINE)
        )

    def last_step(self, lines: Sequence[bytes]) -> ProgressStep | None:
        """The step of the last line of ``lines`` that has one (of the last TAIL_LINES)."""
        tail = lines[-TAIL_LINES:]
        if sum(map(len, tail)) <= TAIL_LINES * MAX_PROGRESS_LINE and not self.may_have_steps(
            b"\n".join(tail)
        ):
            return None  # (most batches: one join and the byte tests in C, no loop in Python)
        for line in reversed(tail):
            if len(line) <= MAX_PROGRESS_LINE:
                step = self.parse(line)
                if step is not None:
                    return step
        return None

    def may_have_steps(self, text: bytes) -> bool:
        """Could a line of ``text`` have a step?  (False: none has.)"""
        if self.pattern is not None:
            return self.joined is None or self.joined.search(text) is not None
        return b"metric:" in text or b"/s" in text or b"s/" in text

    def parse(self, line: bytes) -> ProgressStep | None:
        """One line's step (None: it has none)."""
        if self.pattern is not None:
            return self.parse_own(line)
        # Byte tests first: they cost a few ns, a regex a microsecond.  (The same tests as
        # ``may_have_steps``: a line that passes here passes there.)
        if b"metric:" in line:
            return parse_metric_step(line)
        if b"/s" in line or b"s/" in line:  # (it/s, s/it, and a bar's own unit/s)
            return parse_tqdm(line)
        return None

    def parse_own(self, line: bytes) -> ProgressStep | None:
        assert self.pattern is not None
        found = self.pattern.search(line)
        if found is None or found[self.group] is None:
            return None
        try:
            count = float(found[self.group])
        except ValueError:  # the group matched something that is not a number
            return None
        # ('inf', 'nan', '1e999': numbers to float(), no step: they would make every rate
        # nan, and a nan rate is below any share of the median)
        return ProgressStep(count, "regex") if 0 <= count < float("inf") else None


@dataclass(frozen=True)
class ProgressFigures:
    """What ``dtrain top`` shows of a rank's progress: its step (as it printed it) and its
    steps per second (None: not known yet, or its bar is full)."""

    step: float
    rate: float | None


class Counter:
    """One counter of a rank: (time, steps so far) samples of the last RATE_WINDOW_S."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()
        self.printed = 0.0  # the count as last printed
        self.before = 0.0  # steps of the counter's earlier runs (an epoch's bar ends, restarts)
        self.printed_rate: float | None = None
        self.full = False  # a bar at its total: its steps are done, for now
        self.last = 0.0  # when the last sample came

    def add(self, at: float, step: ProgressStep, window_s: float) -> None:
        if step.count < self.printed:  # it started again: count on from where it was
            self.before += self.printed
        self.printed, self.printed_rate, self.last = step.count, step.printed_rate, at
        self.full = step.total is not None and step.count >= step.total
        self.samples.append((at, self.before + step.count))
        # Keep one sample at or before the window's start: the rate spans the whole window.
        while len(self.samples) > 2 and self.samples[1][0] <= at - window_s:
            self.samples.popleft()

    def steps(self) -> float:
        """Steps done over the samples kept."""
        return self.samples[-1][1] - self.samples[0][1]

    def rate(self, now: float) -> float | None:
        """Steps per second over the window.  A counter that has not moved for longer than
        its steps took (and the time a sample may take to come) slows down as it waits: a
        rank that stopped printing its steps is not going at its last speed."""
        if self.full:
            return None
        (first, counted), (last, reached) = self.samples[0], self.samples[-1]
        if last <= first:
            return self.printed_rate
        steps = reached - counted
        interval = (last - first) / steps if steps > 0 else last - first
        overdue = now - (last + interval + SAMPLE_EVERY_S)
        return steps / (last - first + max(0.0, overdue))


class RankProgress:
    """One rank's counters, and when it next wants a sample."""

    def __init__(
        self, window_s: float = RATE_WINDOW_S, sample_every_s: float = SAMPLE_EVERY_S
    ) -> None:
        self.window_s = window_s
        self.sample_every_s = sample_every_s
        self.counters: dict[str, Counter] = {}
        self.next_sample = float("-inf")

    def wants(self, now: float) -> bool:
        """Is a step due (else its lines need not be looked at)?"""
        return now >= self.next_sample

    def missed(self, now: float) -> None:
        """Its lines had no step: look again a little later, not at every batch (a rank that
        prints no steps, or a flood of other lines, costs at most 1/LOOK_AGAIN_S looks a
        second; a step that comes every few lines is seen at the next)."""
        self.next_sample = now + LOOK_AGAIN_S

    def add(self, at: float, step: ProgressStep) -> None:
        counter = self.counters.get(step.counter)
        if counter is None:
            if len(self.counters) >= MAX_COUNTERS:  # the one heard of longest ago goes
                del self.counters[min(self.counters, key=lambda k: self.counters[k].last)]
            counter = self.counters[step.counter] = Counter()
        counter.add(at, step, self.window_s)
        self.next_sample = at + self.sample_every_s

    def figures(self, now: float) -> ProgressFigures | None:
        """Its step and rate, by the counter that moved most in the window (of nested bars,
        the inner one: every rank is measured by the same one); None: it printed none."""
        if not self.counters:
            return None
        moving = [c for c in self.counters.values() if not c.full] or list(self.counters.values())
        counter = max(moving, key=lambda c: (c.steps(), c.last))
        return ProgressFigures(counter.printed, counter.rate(now))


@dataclass(frozen=True)
class Lagging:
    """A rank to name: its rate over the median's, and how long it has been below."""

    rank: int
    ratio: float
    below_s: float


class StragglerRule:
    """Which ranks run slower than ``ratio`` times the median rate for ``after_s`` seconds:
    each named once per episode.  An episode ends when the rank is back to halfway between
    ``ratio`` and the median (a rank hovering at the line is not named again and again),
    exits, or stops printing its steps."""

    def __init__(
        self, ratio: float = DEFAULT_STRAGGLER_RATIO, after_s: float = DEFAULT_STRAGGLER_AFTER_S
    ) -> None:
        self.ratio = ratio
        self.after_s = after_s
        self.recovered = (ratio + 1) / 2
        self.below_since: dict[int, float] = {}
        self.named: set[int] = set()

    def check(self, rates: Mapping[int, float], now: float) -> list[Lagging]:
        """The ranks to name now, given each running rank's rate (those with one)."""
        for gone in set(self.below_since) - set(rates):
            self.below_since.pop(gone)
            self.named.discard(gone)
        median = median_of(rates.values()) if len(rates) >= MIN_RANKS else 0.0
        if median <= 0:  # too few ranks to tell, or most stand still: nobody is slow
            self.below_since = {r: t for r, t in self.below_since.items() if r in self.named}
            return []
        below: list[Lagging] = []
        for rank, rate in sorted(rates.items()):
            ratio = rate / median
            if rank in self.named:
                if ratio >= self.recovered:
                    self.named.discard(rank)
                    del self.below_since[rank]
            elif ratio >= self.ratio:
                self.below_since.pop(rank, None)
            else:
                below.append(Lagging(rank, ratio, now - self.below_since.setdefault(rank, now)))
        if not any(lagging.below_s >= self.after_s for lagging in below):
            return []
        # The ranks of one slow machine cross the line a sample or two apart: those close
        # behind are named with the first, so that its host is one line, not one per rank.
        joining_s = self.after_s - min(JOIN_S, self.after_s / 4)
        found = [lagging for lagging in below if lagging.below_s >= joining_s]
        self.named.update(lagging.rank for lagging in found)
        return found


def median_of(values: Iterable[float]) -> float:
    """The median (statistics.median, without the 10 ms its imports cost a job's start)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def describe_stragglers(found: Sequence[Lagging], host_of: Mapping[int, str]) -> list[str]:
    """``dtrain: rank 5 on node2 runs at 0.55x the median step rate for 30 s``: one line per
    host (``ranks 4-5 on node2 run at 0.52-0.55x``: a slow machine is one line, not eight)."""
    by_host: dict[str, list[Lagging]] = {}
    for lagging in found:
        by_host.setdefault(host_of.get(lagging.rank, "?"), []).append(lagging)
    lines = []
    for host, group in by_host.items():
        low = min(g.ratio for g in group)
        high = max(g.ratio for g in group)
        ratio = f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"
        below = min(g.below_s for g in group)
        ranks = [g.rank for g in group]
        who = (
            f"rank {ranks[0]} on {host} runs"
            if len(ranks) == 1
            else (f"ranks {rank_set(ranks)} on {host} run")
        )
        lines.append(f"dtrain: {who} at {ratio} the median step rate for {below:.0f} s")
    return lines
