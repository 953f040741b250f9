"""Which lines of several ranks are the same line: a known log prefix's time, pid and
thread id taken out (pure; what ``collapse.Collapser`` compares)."""

from __future__ import annotations

import re
from operator import itemgetter

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


HEADS = itemgetter(slice(0, 1))
PREFIX_STARTS = b"[IWEF0123456789"  # the first bytes of the prefixes ``same_text`` knows
PREFIX_HEADS = frozenset(PREFIX_STARTS[i : i + 1] for i in range(len(PREFIX_STARTS)))


def keys_of(lines: list[bytes]) -> list[bytes]:
    """Each line's ``same_text``; at C speed when no line can start with a known prefix."""
    heads = b"".join(map(HEADS, lines))
    if len(heads.translate(None, PREFIX_STARTS)) == len(heads):
        return lines
    return [same_text(line) if line[:1] and line[0] in PREFIX_STARTS else line for line in lines]
