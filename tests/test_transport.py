"""The status trailer is found whatever the chunking, and program output passes intact."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from launcher.transport.base import StatusFilter
from launcher.remote.watchdog import STATUS_MARK


def filtered(stream: bytes, cuts: list[int]) -> tuple[bytes, int | None]:
    chunks, pos = [], 0
    for size in cuts:
        chunks.append(stream[pos : pos + size])
        pos += size
    chunks.append(stream[pos:])
    pending = [c for c in chunks if c]

    def read(size: int) -> bytes:
        return pending.pop(0) if pending else b""

    status_filter = StatusFilter(read)
    out = b""
    while True:
        data = status_filter.read(65536)
        if not data:
            return out, status_filter.status
        out += data


@given(
    st.binary(max_size=200),
    st.binary(max_size=50),
    st.integers(min_value=-64, max_value=255),
    st.lists(st.integers(min_value=1, max_value=20), max_size=20),
)
def test_trailer_is_cut_out_and_parsed(
    before: bytes, after: bytes, status: int, cuts: list[int]
) -> None:
    stream = before + STATUS_MARK + str(status).encode() + b"\n" + after
    assert filtered(stream, cuts) == (before + after, status)


@given(st.binary(max_size=300), st.lists(st.integers(min_value=1, max_value=20), max_size=20))
def test_output_without_trailer_passes_intact(data: bytes, cuts: list[int]) -> None:
    out, status = filtered(data, cuts)
    assert out == data and (status is None or STATUS_MARK in data)


def test_nul_bytes_in_output_do_not_hide_the_trailer() -> None:
    stream = b"a\0b\0" + STATUS_MARK + b"-9\n"
    assert filtered(stream, [3]) == (b"a\0b\0", -9)
