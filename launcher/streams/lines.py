"""Bytes -> whole lines (DESIGN.md rule 8), and the pump that feeds them on.

A rank's stream arrives in arbitrary chunks; ``LineFramer`` cuts it into
whole lines on ``\\n``, ``\\r\\n`` and bare ``\\r`` (progress bars), never
tearing a line across chunks.  A line that a bare ``\\r`` ended keeps that
``\\r`` as a marker: it is a progress update, which a live view redraws in
place and a log file skips (keeping the final state).  Bytes stay bytes here: decoding (with
replacement of invalid UTF-8) happens where text is shown.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import BinaryIO

from launcher.core.outcome import PROGRESS, READ_BYTES, LineBatch

LINE_BREAK = re.compile(rb"(\r\n|\r|\n)")
MAX_LINE_BYTES = 16 * 1024 * 1024  # a longer "line" is cut; 1 MB lines pass whole


class LineFramer:
    """Incremental splitter: ``feed`` chunks, get back the lines they complete."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self.partial = b""
        self.pieces: list[bytes] = []  # chunks of a long line that has no break yet
        self.pieces_size = 0

    def feed(self, data: bytes) -> Sequence[bytes]:
        if b"\n" not in data and b"\r" not in data and not self.partial.endswith(b"\r"):
            # No break: just collect (joining per chunk would make long lines quadratic).
            self.pieces.append(data)
            self.pieces_size += len(data)
            if self.pieces_size + len(self.partial) <= self.max_line_bytes:
                return []
            data = b""
        partial = self.partial
        if not self.pieces and b"\r" not in data and not partial.endswith(b"\r"):
            # Plain lines (most output): one batch of their bytes, not a bytes object a
            # line, and one copy (the partial line before them joined to them).
            cut = data.rfind(b"\n")
            if cut >= 0 and len(data) - cut - 1 <= self.max_line_bytes:
                self.partial = data[cut + 1 :]
                return LineBatch(b"".join((partial, memoryview(data)[:cut])))
        if self.pieces:
            data = b"".join(self.pieces) + data
            self.pieces, self.pieces_size = [], 0
        buf = self.partial + data if self.partial else data
        if not buf:
            return []
        # A trailing \r may be the first half of \r\n: keep it until the next chunk.
        hold_cr = buf.endswith(b"\r")
        if hold_cr:
            buf = buf[:-1]
        parts = split_lines(buf)
        rest = parts.pop()
        if len(rest) > self.max_line_bytes:
            cut = len(rest) - len(rest) % self.max_line_bytes
            parts.extend(
                rest[i : i + self.max_line_bytes] for i in range(0, cut, self.max_line_bytes)
            )
            rest = rest[cut:]
        self.partial = rest + b"\r" if hold_cr else rest
        return parts

    def finish(self) -> list[bytes]:
        """Lines left at end of stream: a last line without newline still counts."""
        rest, self.partial = self.partial + b"".join(self.pieces), b""
        self.pieces, self.pieces_size = [], 0
        if rest.endswith(b"\r"):
            rest = rest[:-1]
            return [rest]
        return [rest] if rest else []


def split_lines(buf: bytes) -> list[bytes]:
    """Split on \\n, \\r\\n and \\r; a line ended by a bare \\r keeps it (progress update)."""
    if b"\r" not in buf:
        return buf.split(b"\n")
    pieces = LINE_BREAK.split(buf)
    lines = pieces[0::2]
    for i, separator in enumerate(pieces[1::2]):
        if separator == b"\r":
            lines[i] += PROGRESS
    return lines


LineSink = Callable[[Sequence[bytes]], None]


class LinePump:
    """One stream's bytes as they come -> whole lines to ``on_lines``; a raw copy of every
    chunk to ``raw_copy``.  Whoever reads the stream calls ``feed`` and, at its end, ``finish``."""

    def __init__(self, on_lines: LineSink, raw_copy: BinaryIO | None = None) -> None:
        self.on_lines = on_lines
        self.raw_copy = raw_copy
        self.framer = LineFramer()

    def feed(self, chunk: bytes) -> None:
        self.raw_copy = copy_chunk(self.raw_copy, chunk)
        lines = self.framer.feed(chunk)
        if lines:
            self.on_lines(lines)

    def finish(self) -> None:
        """The stream ended: its last line (even without a newline) goes on; the copy closes."""
        try:
            tail = self.framer.finish()
            if tail:
                self.on_lines(tail)
        finally:
            if self.raw_copy is not None:
                try:
                    self.raw_copy.close()
                except OSError:
                    pass
                self.raw_copy = None


def pump_stream(
    read: Callable[[int], bytes],
    on_lines: LineSink,
    raw_copy: BinaryIO | None = None,
) -> None:
    """Read until EOF, handing whole lines to ``on_lines``; a raw copy goes to ``raw_copy``."""
    pump = LinePump(on_lines, raw_copy)
    try:
        while chunk := read(READ_BYTES):
            pump.feed(chunk)
    except OSError:
        pass  # the stream went away with its process: what was read is kept
    finally:
        pump.finish()


def copy_chunk(raw_copy: BinaryIO | None, chunk: bytes) -> BinaryIO | None:
    """Write a chunk to the copy; a failing copy (disk full) is dropped, never the stream."""
    if raw_copy is None:
        return None
    try:
        raw_copy.write(chunk)
        raw_copy.flush()
        return raw_copy
    except OSError:
        try:
            raw_copy.close()
        except OSError:
            pass
        return None
