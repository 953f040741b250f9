"""Slurm's host lists and count lists (pure): ``node[01-04,07]``, ``2(x3),1``.

The syntax, as Slurm defines it (``scontrol show hostnames`` expands the same way;
the tests compare the two over many generated lists):

* a list is tokens separated by commas outside brackets: ``a,b[1-2],c``;
* a token is text with bracket groups; a group holds comma-separated numbers and
  ranges ``lo-hi``; a range keeps the zero padding of its bounds (``[01-10]`` gives
  ``01`` ... ``10``); text may follow a group (``n[1-2]-ib``), and a token may have
  several groups (``rack[1-2]-node[01-02]``: the last group varies fastest);
* order is kept and nothing is de-duplicated.

A count list (``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``) is comma-separated
counts, each optionally repeated: ``2(x3),1`` is 2, 2, 2, 1.
"""

from __future__ import annotations

import itertools
import math
import re

from launcher.base.errors import HostfileError
from launcher.core.bounds import MAX_HOSTS

MAX_DIGITS = 18  # a host number or a count longer than this is a typo (and int() would balk)
_COUNT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_QUOTE_CHARS = 60

Range = tuple[int, int, int]  # low, high, zero-padded width (0: no padding)
Piece = str | tuple[Range, ...]  # text, or a bracket group's ranges


def split_top_level(text: str) -> list[str]:
    """``a,b[1,2],c`` -> ``["a", "b[1,2]", "c"]``: commas inside brackets do not split."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def expand_hostlist(text: str, source: str = "hostlist", limit: int = MAX_HOSTS) -> list[str]:
    """Every host name of a Slurm host list, in order, repeats kept.  The names are counted
    before any is made: a list of more than ``limit`` is refused at once, however its ranges
    multiply (``h[1-1000][1-1000][1-1000]`` would be a billion names)."""
    names: list[str] = []
    for token in split_top_level(text.strip()):
        token = token.strip()
        if not token:
            raise HostfileError(
                f"{source} {quote(text)}: empty item", "separate hosts with single commas"
            )
        pieces = parse_token(token, source)
        count = math.prod(group_size(piece) for piece in pieces if not isinstance(piece, str))
        if len(names) + count > limit:
            raise too_many(source, token if count > limit else text, limit)
        names.extend(expand_pieces(pieces))
    return names


def too_many(source: str, text: str, limit: int) -> HostfileError:
    return HostfileError(
        f"{source}: {quote(text)} gives more than {limit:,} hosts",
        f"check the ranges; dtrain takes at most {limit:,} hosts",
    )


def parse_token(token: str, source: str) -> list[Piece]:
    """One token -> its text and bracket groups, in order (nothing expanded yet)."""
    pieces: list[Piece] = []
    rest = token
    while rest:
        opening = rest.find("[")
        closing = rest.find("]")
        if opening < 0:
            if closing >= 0:
                raise bad(token, source, "']' without '['")
            pieces.append(rest)
            break
        if closing < opening:
            raise bad(token, source, "']' before '['" if closing >= 0 else "missing ']'")
        inner = rest[opening + 1 : closing]
        if "[" in inner:
            raise bad(token, source, "nested '['")
        pieces.extend([rest[:opening], parse_group(inner, token, source)])
        rest = rest[closing + 1 :]
    return pieces


def parse_group(inner: str, token: str, source: str) -> tuple[Range, ...]:
    """The inside of one bracket group: ``01-04,07`` -> ``((1, 4, 2), (7, 7, 0))``."""
    if not inner:
        raise bad(token, source, "empty '[]'")
    ranges: list[Range] = []
    for item in inner.split(","):
        found = _RANGE.fullmatch(item.strip())
        if not found:
            raise bad(token, source, f"{quote(item)} is not a number or a range like 1-4")
        low, high = found[1], found[2] if found[2] is not None else found[1]
        if max(len(low), len(high)) > MAX_DIGITS:
            raise bad(token, source, f"{quote(item)} has a number of over {MAX_DIGITS} digits")
        if int(high) < int(low):
            raise bad(token, source, f"range {quote(item)} goes down")
        width = len(low) if low.startswith("0") and len(low) > 1 else 0
        ranges.append((int(low), int(high), width))
    return tuple(ranges)


def group_size(ranges: tuple[Range, ...]) -> int:
    return sum(high - low + 1 for low, high, _ in ranges)


def expand_pieces(pieces: list[Piece]) -> list[str]:
    """The names of one parsed token (the last group varies fastest)."""
    choices = [
        [piece]
        if isinstance(piece, str)
        else [str(n).zfill(width) for low, high, width in piece for n in range(low, high + 1)]
        for piece in pieces
    ]
    return ["".join(parts) for parts in itertools.product(*choices)]


def bad(token: str, source: str, problem: str) -> HostfileError:
    return HostfileError(
        f"{source}: bad host range {quote(token)}: {problem}",
        "write ranges as Slurm does, e.g. 'node[01-04,07]'",
    )


def quote(text: str) -> str:
    """``repr`` of user text, cut short so that one huge line cannot flood the terminal."""
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def expand_counts(text: str, source: str = "count list", limit: int = MAX_HOSTS) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (Slurm's SLURM_TASKS_PER_NODE syntax)."""
    counts: list[int] = []
    for item in text.strip().split(","):
        found = _COUNT.fullmatch(item.strip())
        if not found:
            raise HostfileError(
                f"{source} {quote(text)}: bad item {quote(item)}",
                "write counts as Slurm does: 2(x3),1",
            )
        if max(len(found[1]), len(found[2] or "")) > MAX_DIGITS:
            raise HostfileError(
                f"{source} {quote(text)}: {quote(item)} has a number of over {MAX_DIGITS} digits",
                "check the list",
            )
        repeat = int(found[2]) if found[2] is not None else 1
        if repeat < 1:  # ``2(x0)`` would drop the count, and the list no longer match its nodes
            raise HostfileError(
                f"{source} {quote(text)}: bad item {quote(item)}: repeated 0 times",
                "write counts as Slurm does: 2(x3),1",
            )
        if len(counts) + repeat > limit:
            raise HostfileError(
                f"{source} {quote(text)}: more than {limit:,} counts", "check the list"
            )
        counts.extend([int(found[1])] * repeat)
    return counts


def check_host_total(count: int, source: str, limit: int = MAX_HOSTS) -> None:
    """A whole -H list or hostfile, ``count`` hosts so far: at most ``limit`` (each of its
    items is bounded by ``expand_hostlist``; this bounds their sum)."""
    if count > limit:
        raise HostfileError(
            f"{source}: more than {limit:,} hosts", f"dtrain takes at most {limit:,} hosts"
        )
