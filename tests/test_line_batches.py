"""Plain lines travel as one batch (``LineBatch``) from the pipe to every sink: framing,
tagging, the job directory and the terminal give the same lines as line by line."""

from __future__ import annotations

import io
import os
import random
import threading
import tracemalloc
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import LineBatch, batch_lines
from launcher.core.results import RESULT_MARK
from launcher.streams.jobdir import JobDir
from launcher.streams.lines import LineFramer, split_lines
from launcher.streams.outlets import LINE_OVERHEAD_BYTES, lines_size
from launcher.streams.recorder import JobRecorder
from launcher.view.frontend import TerminalFile
from launcher.view.lineviews import LineView


def spec(rank: int = 0) -> LaunchSpec:
    return LaunchSpec(rank=rank, host=Host("localhost", 1), local_rank=rank, argv=("true",), env={})


def test_a_batch_is_its_lines() -> None:
    batch = LineBatch(b"one\n\nthree\nfour")
    assert len(batch) == 4 and bool(batch)
    assert batch[-1] == b"four"  # without splitting it
    assert batch[-2:] == [b"three", b"four"]
    assert batch[-10:] == [b"one", b"", b"three", b"four"]
    assert list(batch) == [b"one", b"", b"three", b"four"]
    assert batch[0] == b"one" and batch[1:3] == [b"", b"three"]
    assert batch_lines(batch) == b"one\n\nthree\nfour" == batch_lines(list(batch))
    assert len(LineBatch(b"")) == 1 and list(LineBatch(b"")) == [b""]


def reference_lines(stream: bytes) -> list[bytes]:
    """What a stream's lines are, framed at once: the chunking must not matter."""
    lines = split_lines(stream)
    return lines[:-1] + ([lines[-1]] if lines[-1] else [])


@pytest.mark.parametrize("seed", range(6))
def test_any_chunking_gives_the_same_lines(seed: int) -> None:
    chance = random.Random(seed)
    pieces = [b"plain line %d" % i for i in range(300)]
    for i in chance.sample(range(300), 30):  # some progress updates and CRLFs among them
        pieces[i] += chance.choice([b"\r", b"\r\n"])
    stream = b"\n".join(pieces).replace(b"\r\n\n", b"\r\n") + b"\ntail"
    cuts = sorted(chance.sample(range(1, len(stream)), 40))
    framer = LineFramer()
    got: list[bytes] = []
    batches = 0
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        lines = framer.feed(stream[start:end])
        batches += isinstance(lines, LineBatch)
        got.extend(lines)
    got.extend(framer.finish())
    assert got == reference_lines(stream)
    assert batches > 0  # chunks of plain lines came as batches


def test_plain_chunks_come_as_batches_and_progress_bars_as_lines() -> None:
    framer = LineFramer()
    first = framer.feed(b"a\nb\nc")
    assert isinstance(first, LineBatch) and list(first) == [b"a", b"b"]
    assert list(framer.feed(b"\n10%\r20%\r")) == [b"c", b"10%\r"]  # \r: line by line
    assert list(framer.feed(b"\n")) == [b"20%"]  # (the held \r was half of \r\n)


def test_a_batch_costs_the_queue_its_bytes() -> None:
    batch = LineBatch(b"x" * 100 + b"\n" + b"y" * 50)
    assert lines_size(batch) == 151 + LINE_OVERHEAD_BYTES
    assert lines_size([b"x" * 100, b"y" * 50]) == 150 + 2 * LINE_OVERHEAD_BYTES


def test_a_batch_a_sink_looked_through_still_holds_only_its_bytes() -> None:
    # One batch is queued for every outlet: once the view has gone through its lines, the
    # job directory's queue still holds it, and must not hold its lines as objects too
    # (short lines cost ~15 times their bytes so: past what lines_size told the queue).
    batch = LineBatch(b"ab\n" * 20_000 + b"ab")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert sum(1 for _ in batch) == len(batch) == 20_001  # (a view's pass over them)
        assert list(batch[0:2]) == [b"ab", b"ab"]
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < lines_size(batch) // 4  # (nothing near the 780 kB its lines would be)


def test_the_job_directory_gets_a_batch_stamped_and_results_apart(tmp_path: Path) -> None:
    job = JobDir.create(tmp_path, "job-1", {})
    recorder = JobRecorder(job, clock=lambda: 12.5)
    result = RESULT_MARK + b"token value 0 abc"
    recorder.show(spec(), "stdout", LineBatch(b"first\n" + result + b"\nlast"))
    recorder.show(spec(), "stderr", LineBatch(b"warning"))
    recorder.close_files()
    log = (job.path / "rank.0.log").read_bytes()
    assert log == b"12.500000 o first\n12.500000 o last\n12.500000 e warning\n"
    assert (job.path / "results" / "rank.0").read_bytes() == result + b"\n"


class Stdout(io.TextIOWrapper):
    """A text file over bytes, as sys.stdout is."""

    def __init__(self, encoding: str = "utf-8") -> None:
        super().__init__(io.BytesIO(), encoding=encoding, newline="")

    def value(self) -> bytes:
        self.flush()
        raw = self.buffer
        assert isinstance(raw, io.BytesIO)
        return raw.getvalue()


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_the_terminal_gets_tagged_lines_in_order(encoding: str) -> None:
    out = Stdout(encoding)
    terminal = TerminalFile(out)
    view = LineView(terminal, terminal)  # type: ignore[arg-type]
    assert (terminal.raw is not None) == (encoding == "utf-8")  # ASCII as bytes where it can
    view.show(spec(0), "stdout", LineBatch(b"one\ntwo"))
    terminal.write("dtrain: a notice\n")  # text between batches keeps its place
    view.show(spec(1), "stdout", [b"list", b"of lines"])
    view.show(spec(1), "stdout", LineBatch("caf\u00e9 \xff".encode("latin-1") + b"\nok"))
    want = (
        "[0] one\n[0] two\ndtrain: a notice\n[1] list\n[1] of lines\n[1] caf\ufffd \ufffd\n[1] ok\n"
    )
    assert out.value().decode(encoding) == want


class TeeStdout(Stdout):
    """A caller's sys.stdout that copies what is written through it (a log of the run)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[str] = []

    def write(self, text: str) -> int:
        self.copied.append(text)
        return super().write(text)


def test_a_file_whose_write_does_more_gets_every_line_through_it() -> None:
    # launch() shows the ranks' lines on the caller's sys.stdout: where its class does more
    # in ``write`` (a tee), its bytes underneath are no way around that.
    out = TeeStdout()
    terminal = TerminalFile(out)
    view = LineView(terminal, terminal)  # type: ignore[arg-type]
    view.show(spec(0), "stdout", LineBatch(b"one\ntwo"))
    assert "".join(out.copied) == "[0] one\n[0] two\n"
    assert out.value() == b"[0] one\n[0] two\n"


def test_an_unbuffered_terminal_that_takes_part_of_a_write_gets_the_rest() -> None:
    # PYTHONUNBUFFERED: sys.stdout is text straight over the file; a non-blocking terminal
    # (another program left it so) takes what fits and no more: the rest must follow.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    out = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8", write_through=True)
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    terminal = TerminalFile(out)
    view = LineView(terminal, terminal)  # type: ignore[arg-type]
    many = [b"line %d" % i for i in range(50_000)]
    view.show(spec(0), "stdout", LineBatch(b"\n".join(many)))  # ASCII: as bytes
    view.show(spec(1), "stdout", [*many, "caf\u00e9".encode()])  # not ASCII: as text
    terminal.write("dtrain: the end\n")
    out.close()
    reader.join()
    os.close(read_end)
    want = b"".join(b"[0] %s\n" % line for line in many)
    want += b"".join(b"[1] %s\n" % line for line in [*many, "caf\u00e9".encode()])
    assert bytes(got) == want + b"dtrain: the end\n"


def test_a_text_only_file_gets_the_same_lines() -> None:
    out = io.StringIO()
    view = LineView(out, out)
    view.show(spec(2), "stdout", LineBatch(b"a\n\xc3\xa9"))
    assert out.getvalue() == "[2] a\n[2] \u00e9\n"
