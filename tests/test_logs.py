"""Line framing: whole lines whatever the chunking."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

from launcher.streams.lines import LineFramer, pump_stream


def frame(chunks: list[bytes], max_line_bytes: int = 1 << 24) -> list[bytes]:
    framer = LineFramer(max_line_bytes)
    lines: list[bytes] = []
    for chunk in chunks:
        lines.extend(framer.feed(chunk))
    return lines + framer.finish()


def test_newlines_carriage_returns_and_crlf() -> None:
    assert frame([b"a\nb\r\nc\rd"]) == [b"a", b"b", b"c\r", b"d"]
    # progress updates keep their \r as a marker; the newline closes the final state
    assert frame([b"progress 1\rprogress 2\rdone\n"]) == [b"progress 1\r", b"progress 2\r", b"done"]


def test_crlf_split_across_chunks_is_one_break() -> None:
    assert frame([b"a\r", b"\nb\n"]) == [b"a", b"b"]
    assert frame([b"a\r", b"b\n"]) == [b"a\r", b"b"]
    assert frame([b"a\r"]) == [b"a"]


def test_last_line_without_newline() -> None:
    assert frame([b"one\ntw", b"o"]) == [b"one", b"two"]
    assert frame([b""]) == []
    assert frame([b"\n\n"]) == [b"", b""]


def test_huge_line_is_whole_and_overlong_is_cut() -> None:
    big = b"x" * (3 * 1024 * 1024)
    chunks = [big[i : i + 65536] for i in range(0, len(big), 65536)] + [b"\nend\n"]
    assert frame(chunks) == [big, b"end"]
    # the cap bounds what is buffered while no line break comes
    assert frame([b"abcdefg"], max_line_bytes=3) == [b"abc", b"def", b"g"]


def test_invalid_utf8_passes_as_bytes() -> None:
    assert frame([b"\xff\xfe bad\n\xc3"]) == [b"\xff\xfe bad", b"\xc3"]


@given(st.binary(max_size=400), st.lists(st.integers(min_value=1, max_value=50), max_size=30))
def test_any_chunking_gives_the_same_lines(data: bytes, cuts: list[int]) -> None:
    chunks, pos = [], 0
    for size in cuts:
        chunks.append(data[pos : pos + size])
        pos += size
    chunks.append(data[pos:])
    assert frame(chunks) == reference_lines(data)


def reference_lines(data: bytes) -> list[bytes]:
    """The lines of ``data``, byte by byte (an oracle independent of the framer's regex):
    ``\\n``, ``\\r\\n`` and a bare ``\\r`` end a line, and a bare ``\\r`` marks it as a
    progress update, except at the very end, where the last state is final."""
    lines, line, i = [], b"", 0
    while i < len(data):
        byte = data[i : i + 1]
        if byte == b"\n":
            lines.append(line)
            line = b""
        elif byte == b"\r" and data[i + 1 : i + 2] == b"\n":
            lines.append(line)
            line = b""
            i += 1
        elif byte == b"\r":
            lines.append(line + (b"\r" if i + 1 < len(data) else b""))
            line = b""
        else:
            line += byte
        i += 1
    if line:
        lines.append(line)
    return lines


def test_pump_copies_raw_bytes_and_frames_lines() -> None:
    source = io.BytesIO(b"a\r\nb\rc")
    copy = io.BytesIO()
    copy.close = lambda: None  # type: ignore[method-assign]  # keep it readable after pump
    seen: list[bytes] = []
    pump_stream(source.read, seen.extend, copy)
    assert seen == [b"a", b"b\r", b"c"]
    assert copy.getvalue() == b"a\r\nb\rc"
