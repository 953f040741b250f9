"""Identical lines from several ranks, shown once: ``[0-7] text`` (pure; the time comes in).

With 8 ranks every library warning arrives 8 times.  ``Collapser`` groups lines
that have the same stream and text, arriving within a window (0.5 s by
default), and lets each group out once, tagged with the set of ranks that said
it.  Rules:

* lines that differ only in a log prefix's time, pid or thread id are the same
  (glog's ``[W1123 08:38:17.186481407 socket.cpp:207]``, absl's
  ``I0000 00:00:1795423122.942183   23605 port.cc:153]``, a logging timestamp);
  the group shows the first rank's text.  Lines that differ anywhere else (a rank
  number, a loss) are never merged;
* every rank's lines come out in the order it wrote them: a line may join a
  group only if that group is newer than the rank's previous line's group;
* a group comes out when its window closes (or at once when every rank has
  joined it), so no line waits longer than the window; groups come out in the
  order they were made.

Expanding what comes out (each group into one line per rank) gives back exactly
each rank's lines in order: the property the tests check on random interleavings.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter

DEFAULT_WINDOW_S = 0.5
MAX_HELD = 50_000  # lines held at most: a flood comes out early rather than piling up

# Log prefixes whose time, pid and thread id vary between ranks (kept: severity, file:line).
PREFIXES = (
    # torch/c10: [W1123 08:38:17.186481407 socket.cpp:207]
    (re.compile(rb"^\[([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ ([^\]\s]+:\d+)\]"), rb"[\1 \2]"),
    # glog / absl: I0000 00:00:1795423122.942183   23605 port.cc:153]
    (re.compile(rb"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]\s]+:\d+)\]"), rb"\1 \2]"),
    # Python logging's asctime: 2026-11-23 08:38:17,186 (and ISO 8601 with T)
    (re.compile(rb"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)?"), rb"<time>"),
)


def same_text(line: bytes) -> bytes:
    """The line with a known log prefix's varying parts taken out: what groups compare."""
    for pattern, replacement in PREFIXES:
        line, found = pattern.subn(replacement, line, count=1)
        if found:
            break
    return line


@dataclass(frozen=True)
class Collapsed:
    """Lines as shown: their text once, for these ranks (ascending)."""

    ranks: tuple[int, ...]
    stream: str
    lines: tuple[bytes, ...]
    time: float = field(default=0.0, compare=False)  # when the first of them came


@dataclass(eq=False)
class Block:
    """A batch of one rank's lines, held for the window; other ranks' same lines join its
    lines (``joined``: line index -> every rank that said it, this block's rank first)."""

    rank: int
    stream: str
    lines: list[bytes]
    keys: list[bytes]
    first: float
    serial: int  # its first line's; line i is serial + i (the order of everything held)
    joined: dict[int, list[int]] = field(default_factory=dict)
    joins_left: int = 0  # joins until every rank said every line
    index: dict[bytes, int] | None = None  # key -> its last line (made at the first join)
    shown: int = 0  # lines before this one were let out (every rank had said them)
    done: bool = False

    def line_of(self, key: bytes) -> int:
        if self.index is None:
            self.index = dict(zip(self.keys, range(len(self.keys)), strict=True))
        return self.index[key]

    def items(self, start: int, end: int) -> list[Collapsed]:
        """Lines ``start:end`` as shown: runs of this rank's own lines, and each joined line
        with its ranks, in order."""
        out, own = [], (self.rank,)
        for i in sorted(i for i in self.joined if start <= i < end):
            if start < i:
                out.append(Collapsed(own, self.stream, tuple(self.lines[start:i]), self.first))
            ranks = tuple(sorted(self.joined[i]))
            out.append(Collapsed(ranks, self.stream, (self.lines[i],), self.first))
            start = i + 1
        if start < end:
            out.append(Collapsed(own, self.stream, tuple(self.lines[start:end]), self.first))
        return out


class Collapser:
    """Feed it lines as they come; it gives back what to show, and when.

    Lines come in batches (what a rank's reader got at once); a batch that no other rank's
    held line matches is held whole as one ``Block``, with C-speed work per line only (its
    keys into a dict), so a flood of distinct lines costs little.  A line matching another
    rank's held line joins it, if that keeps the rank's order.
    """

    def __init__(self, world_size: int, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.world_size = world_size
        self.window_s = window_s
        self.pending: deque[Block] = deque()
        self.held = 0  # lines in ``pending``
        # stream -> key -> the newest block holding that key, in two generations (young,
        # old): when the young one has had MAX_HELD keys put in, it becomes the old one and
        # the old one goes, emitted blocks with it (a block still held is always in one).
        self.open: dict[str, tuple[dict[bytes, Block], dict[bytes, Block]]] = {}
        self.put = 0  # keys put in the young generations since they were made
        self.last_serial: dict[int, int] = {}  # rank -> serial of its latest line
        self.serial = 0

    def add(self, rank: int, stream: str, text: bytes, now: float) -> list[Collapsed]:
        """One line of one rank: see ``add_lines``."""
        return self.add_lines(rank, stream, [text], now)

    def add_lines(self, rank: int, stream: str, lines: list[bytes], now: float) -> list[Collapsed]:
        """A batch of one rank's lines; returns what is due now (a group every rank has
        joined, windows closed, or the oldest lines when too many are held)."""
        keys = keys_of(lines)
        young, old = self.open.get(stream) or self.open.setdefault(stream, ({}, {}))
        joined = 0
        if not (young.keys().isdisjoint(keys) and old.keys().isdisjoint(keys)):
            joined = self.join(rank, young, old, keys)  # some line may join another rank's
        if joined < len(lines):
            self.hold(rank, stream, lines[joined:], keys[joined:], now)
        return self.due(now)

    def join(
        self, rank: int, young: dict[bytes, Block], old: dict[bytes, Block], keys: list[bytes]
    ) -> int:
        """Join the batch's first lines to other ranks' held ones while that keeps this
        rank's order; how many joined (the rest is held as a block of its own)."""
        for count, key in enumerate(keys):
            block = young.get(key) or old.get(key)
            if block is None or block.done or block.rank == rank:
                return count
            i = block.line_of(key)
            ranks = block.joined.setdefault(i, [block.rank])
            if block.serial + i <= self.last_serial.get(rank, -1) or rank in ranks:
                if len(ranks) == 1:
                    del block.joined[i]
                return count
            ranks.append(rank)
            block.joins_left -= 1
            self.last_serial[rank] = block.serial + i
        return len(keys)

    def hold(
        self,
        rank: int,
        stream: str,
        lines: list[bytes],
        keys: list[bytes],
        now: float,
    ) -> None:
        block = Block(rank, stream, lines, keys, now, self.serial)
        block.joins_left = len(lines) * (self.world_size - 1)
        self.serial += len(lines)
        self.last_serial[rank] = self.serial - 1
        self.pending.append(block)
        self.held += len(lines)
        if self.put >= MAX_HELD:  # a new generation (every stream's: they share ``put``)
            self.open = {name: ({}, young) for name, (young, _) in self.open.items()}
            self.put = 0
        self.open[stream][0].update(zip(keys, repeat(block)))
        self.put += len(keys)

    def due(self, now: float) -> list[Collapsed]:
        """The blocks whose window closed (or that every rank joined), oldest first; the
        oldest too when more than ``MAX_HELD`` lines wait (a flood comes out early)."""
        out = []
        while self.pending:
            head = self.pending[0]
            if head.joins_left > 0 and now - head.first < self.window_s and self.held <= MAX_HELD:
                out += self.emit_said_by_all(head)
                break
            out += self.emit(self.pending.popleft())
        return out

    def emit_said_by_all(self, block: Block) -> list[Collapsed]:
        """The block's first lines that every rank has said: out now, not at the window."""
        end = block.shown
        while len(block.joined.get(end, ())) == self.world_size:
            end += 1
        if end == block.shown:
            return []
        out = block.items(block.shown, end)
        self.held -= end - block.shown
        block.shown = end
        return out

    def flush(self) -> list[Collapsed]:
        """Everything still held (the job ended)."""
        out = []
        while self.pending:
            out += self.emit(self.pending.popleft())
        return out

    def next_due(self) -> float | None:
        """When the oldest block's window closes (None: nothing held)."""
        return self.pending[0].first + self.window_s if self.pending else None

    def emit(self, block: Block) -> list[Collapsed]:
        block.done = True
        self.held -= len(block.lines) - block.shown
        return block.items(block.shown, len(block.lines))


HEADS = itemgetter(slice(0, 1))
PREFIX_STARTS = b"[IWEF0123456789"  # the first bytes of the prefixes ``same_text`` knows


def keys_of(lines: list[bytes]) -> list[bytes]:
    """Each line's ``same_text``; at C speed when no line can start with a known prefix."""
    heads = b"".join(map(HEADS, lines))
    if len(heads.translate(None, PREFIX_STARTS)) == len(heads):
        return lines
    return [same_text(line) if line[:1] and line[0] in PREFIX_STARTS else line for line in lines]


def rank_set(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in ordered:
        if start is None:
            start = previous = rank
        elif previous is not None and rank == previous + 1:
            previous = rank
        else:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = previous = rank
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def expand(items: Sequence[Collapsed]) -> dict[int, list[tuple[str, bytes]]]:
    """Each rank's lines back from collapsed output (its own text where it had one of its own
    is the first rank's: the same up to the log prefix)."""
    lines: dict[int, list[tuple[str, bytes]]] = {}
    for item in items:
        for rank in item.ranks:
            lines.setdefault(rank, []).extend((item.stream, same_text(t)) for t in item.lines)
    return lines
