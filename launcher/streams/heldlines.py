"""The lines ``collapse.Collapser`` holds: blocks of one rank's lines, with the ranks that
said each of them kept in runs, and the slice work that matches another rank's batch
against them at C speed (pure).

A flood of identical lines from 8 ranks is millions of lines: what is done for each of them
in Python is what it costs (a look-up and a list of ranks per line held 8 ranks' identical
lines to 230 k lines/s).  So a rank's batch is matched against a held block a run at a
time (slices compared, not lines looked up), and who said the lines is kept per run of lines
(``Block.starts``, ``Block.saids``), not per line: a run joins, waits and comes out in one
step.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

HOLD_S = 2.0  # a line some ranks said waits for the others this long after the latest of them
HOLD_MAX_S = 10.0  # and this long after the first at most


@dataclass(frozen=True)
class Collapsed:
    """Lines as shown: their text once, for these ranks (ascending)."""

    ranks: tuple[int, ...]
    stream: str
    lines: Sequence[bytes]  # a tuple (or a rank's batch as it came, where a flood passes)
    time: float = field(default=0.0, compare=False)  # when the first of them came


@dataclass(eq=False)
class Block:
    """A batch of one rank's lines, held for the window; other ranks' same lines join its
    lines.  Who said them is kept in runs: run k is lines ``starts[k]`` up to the next run's
    start (or the end), said by the ranks ``saids[k]`` (ascending: this block's rank alone
    until another joins); neighbouring runs never have the same ranks.  Line i stands at
    position ``serial + i * step`` in the output's order."""

    rank: int
    stream: str
    lines: list[bytes]
    keys: list[bytes]
    first: float
    serial: float
    step: float = 1.0
    starts: list[int] = field(default_factory=lambda: [0])
    saids: list[tuple[int, ...]] = field(default_factory=list)
    index: dict[bytes, int] | None = None  # key -> its last line (made when first needed)
    shown: int = 0  # lines before this one were let out
    done: bool = False
    # For the ranks that have not said its lines yet: the most lines on the stream that a
    # rank saying them had said by then, and when another rank last joined them.
    reach: int = 0
    heard: float = -math.inf

    def __post_init__(self) -> None:
        if not self.saids:
            self.saids.append((self.rank,))

    def at(self, i: int) -> float:
        return self.serial + i * self.step

    @property
    def shared(self) -> bool:
        """Has another rank said any of its lines?"""
        return len(self.saids) > 1 or len(self.saids[0]) > 1

    def count_upto(self, position: float) -> int:
        """How many of its lines stand at ``position`` or before."""
        count = len(self.lines)
        if position < self.serial:
            return 0
        if position == math.inf:
            return count
        end = min(count, max(0, math.floor((position - self.serial) / self.step) + 1))
        while end < count and self.at(end) <= position:
            end += 1
        while end > 0 and self.at(end - 1) > position:
            end -= 1
        return end

    def lines_upto(self, position: float) -> int:
        """The end of its lines standing at ``position`` or before (at least one more)."""
        return max(self.shown + 1, self.count_upto(position))

    def line_of(self, key: bytes, start: int) -> int:
        """A line of the block with this key (it has one): the first from ``start`` on, found
        by a scan from there (where a rank's lines go on as the block's do, it is at
        ``start``); failing that the last, by an index of every key made then (a dict of
        the block's lines, which a flood of identical lines seldom needs: it would hold a
        third of what a held line costs)."""
        if self.index is None:
            try:
                return self.keys.index(key, start)
            except ValueError:
                self.index = dict(zip(self.keys, range(len(self.keys)), strict=True))
        return self.index[key]

    def run_at(self, line: int) -> int:
        return bisect.bisect_right(self.starts, line) - 1

    def run_end(self, run: int) -> int:
        return self.starts[run + 1] if run + 1 < len(self.starts) else len(self.lines)

    def said_by(self, line: int) -> tuple[int, ...]:
        return self.saids[self.run_at(line)]

    def spans(self, start: int, end: int) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """Lines ``start:end`` in runs said by the same ranks: (first, end, ranks) each."""
        run = self.run_at(start)
        while start < end:
            stop = min(end, self.run_end(run))
            yield start, stop, self.saids[run]
            start, run = stop, run + 1

    def said_by_all_upto(self, world_size: int) -> int:
        """The end of the lines from the next one to show on that every rank has said."""
        run = self.run_at(self.shown)
        return self.run_end(run) if len(self.saids[run]) >= world_size else self.shown

    def add_rank(self, start: int, end: int, rank: int) -> list[tuple[int, int]]:
        """``rank`` said lines ``start:end`` too (it had said none of them); returns the spans
        among them that no other rank had joined before (first, end)."""
        first = self.split_at(start)
        last = self.split_at(end) if end < len(self.lines) else len(self.starts)
        fresh = []
        for run in range(first, last):
            said = self.saids[run]
            if len(said) == 1:
                fresh.append((self.starts[run], self.run_end(run)))
            self.saids[run] = tuple(sorted((*said, rank)))
        self.merge(max(first - 1, 0), min(last + 1, len(self.starts)))
        return fresh

    def split_at(self, line: int) -> int:
        """A run starting at ``line`` (inside the block): its index."""
        run = self.run_at(line)
        if self.starts[run] != line:
            run += 1
            self.starts.insert(run, line)
            self.saids.insert(run, self.saids[run - 1])
        return run

    def merge(self, low: int, high: int) -> None:
        """Neighbouring runs among ``low:high`` said by the same ranks become one."""
        starts, saids = self.starts, self.saids
        for run in range(high - 1, low, -1):
            if saids[run] == saids[run - 1]:
                del starts[run], saids[run]

    def items(self, start: int, end: int, time: float) -> list[Collapsed]:
        """Lines ``start:end`` as shown (at ``time``): one item per run of lines that the
        same ranks said, in order."""
        stream, lines = self.stream, self.lines
        return [
            Collapsed(said, stream, tuple(lines[first:stop]), time)
            for first, stop, said in self.spans(start, end)
        ]

    def waits_until(self) -> float:
        """How long a line of it that some ranks said waits for the others at most."""
        return min(self.heard + HOLD_S, self.first + HOLD_MAX_S)


@dataclass
class Track:
    """One rank's lines on one stream: where its newest line stands, where its newest line
    that another rank shares stands, and its held blocks after that one which no other rank
    joined (free to move earlier, since nothing else depends on where they stand)."""

    last: float = -math.inf
    anchor: float = -math.inf
    free: list[Block] = field(default_factory=list)
    count: int = 0  # lines the rank said on the stream so far


def known_lines(keys: list[bytes], start: int, *tables: dict[bytes, Block]) -> list[int]:
    """The indexes from ``start`` on of the keys that any of the tables has, ascending (at
    C speed)."""
    rest = keys[start:]
    flags = None
    for table in tables:
        if table:
            found = map(table.__contains__, rest)
            flags = found if flags is None else map(operator.or_, flags, found)
    return [] if flags is None else list(itertools.compress(range(start, len(keys)), flags))


def common_run(keys: list[bytes], start: int, other: list[bytes], other_start: int) -> int:
    """How many keys from ``start`` on are ``other``'s from ``other_start`` on (the first
    are: at least one).  Slices compared in doubling steps, then halving: a run of n lines
    costs O(n) at C speed and O(log n) steps in Python, one line O(1)."""
    most = min(len(keys) - start, len(other) - other_start)
    good, step = 1, 1
    while good < most:
        probe = min(most, good + step)
        if keys[start + good : start + probe] != other[other_start + good : other_start + probe]:
            bad = probe
            while bad - good > 1:  # the first `good` match, the first `bad` do not
                middle = (good + bad) // 2
                if (
                    keys[start + good : start + middle]
                    == other[other_start + good : other_start + middle]
                ):
                    good = middle
                else:
                    bad = middle
            return good
        good, step = probe, step * 2
    return good


def next_position(block: Block) -> float:
    """Where the block's next line to show stands: what ``pending`` is sorted by."""
    return block.serial + block.shown * block.step


def spacing(after: float, before: float, count: int) -> tuple[float, float] | None:
    """Where ``count`` lines go between two positions: the first one's and the step; None
    when there is no room (or floating point has none left)."""
    if before <= after:
        return None
    if after == -math.inf:
        after = before - count - 1
    step = (before - after) / (count + 1)
    if count and not (after < after + step and after + count * step < before):
        return None
    return after + step, step
