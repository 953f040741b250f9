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

DEFAULT_WINDOW_S = 0.5
MAX_PENDING = 10_000  # groups held at most: a flood comes out early rather than piling up

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


@dataclass
class Group:
    key: tuple[str, bytes]  # (stream, same_text)
    text: bytes  # the first rank's text
    first: float  # when its first line came
    ranks: list[int] = field(default_factory=list)
    serial: int = 0


@dataclass(frozen=True)
class Collapsed:
    """A line as shown: its text once, for these ranks (ascending)."""

    ranks: tuple[int, ...]
    stream: str
    text: bytes


class Collapser:
    """Feed it lines as they come; it gives back what to show, and when."""

    def __init__(self, world_size: int, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.world_size = world_size
        self.window_s = window_s
        self.pending: deque[Group] = deque()
        self.open: dict[tuple[str, bytes], Group] = {}  # the newest pending group per key
        self.last_serial: dict[int, int] = {}  # rank -> serial of its latest line's group
        self.serial = 0

    def add(self, rank: int, stream: str, text: bytes, now: float) -> list[Collapsed]:
        """One line of one rank; returns what is due now (this line's group included if every
        rank has said it)."""
        key = (stream, same_text(text))
        group = self.open.get(key)
        if group is None or group.serial <= self.last_serial.get(rank, -1) or rank in group.ranks:
            self.serial += 1
            group = Group(key, text, now, serial=self.serial)
            self.pending.append(group)
            self.open[key] = group
        group.ranks.append(rank)
        self.last_serial[rank] = group.serial
        return self.due(now)

    def due(self, now: float) -> list[Collapsed]:
        """The groups whose window closed (or that every rank joined), oldest first."""
        out = []
        while self.pending:
            head = self.pending[0]
            full = len(head.ranks) >= self.world_size
            if not (full or now - head.first >= self.window_s or len(self.pending) > MAX_PENDING):
                break
            out.append(self.emit(self.pending.popleft()))
        return out

    def flush(self) -> list[Collapsed]:
        """Everything still held (the job ended)."""
        out = [self.emit(group) for group in self.pending]
        self.pending.clear()
        return out

    def next_due(self) -> float | None:
        """When the oldest group's window closes (None: nothing held)."""
        return self.pending[0].first + self.window_s if self.pending else None

    def emit(self, group: Group) -> Collapsed:
        if self.open.get(group.key) is group:
            del self.open[group.key]
        return Collapsed(tuple(sorted(group.ranks)), group.key[0], group.text)


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
            lines.setdefault(rank, []).append((item.stream, same_text(item.text)))
    return lines
