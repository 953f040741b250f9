"""What a job's run produces, as values (pure): rank states, the failure report, the result.

These types sit below everyone who uses them: the supervisor fills them in,
the job directory (``streams/recorder.py``) and the view (``launcher/view/``) read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

if TYPE_CHECKING:
    from launcher.core.command import LaunchSpec

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
PROGRESS = b"\r"  # kept at the end of a line a bare \r ended: a progress update (logs.py)
READ_BYTES = 256 * 1024  # one read of a rank's pipe or stream (logs.py, transport/feeds.py)
TAIL_LINES = 20  # kept per rank and stream for the failure report
TAIL_LINE_BYTES = 4096  # of each such line: memory stays bounded whatever a rank prints


class LineBatch(Sequence[bytes]):
    """Whole lines a rank printed, kept as one block: ``data`` is the lines joined by
    ``b"\\n"`` (no newline after the last), and holds no ``\\r`` (no progress update).

    A chunk of plain lines travels from the pipe to every sink as the bytes it came in: a
    sink that tags or timestamps lines does it with one ``bytes.replace`` over ``data``,
    and only a sink that looks at lines one by one makes them (``lines``).  Splitting
    millions of lines into objects was most of what heavy output cost.

    The lines made are never kept on the batch: one batch is queued for every outlet, and
    a queue counts its bytes (``outlets.lines_size``); the view's pass over a batch must
    not leave it holding a bytes object a line (~15 times the bytes of short lines) while
    it waits in the job directory's queue.
    """

    __slots__ = ("data", "nlines")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nlines = -1  # counted when asked (a count is a pass over the bytes)

    @property
    def lines(self) -> list[bytes]:
        """The lines, made anew at each call (kept by the caller, as long as it needs them)."""
        return self.data.split(b"\n")

    def __bool__(self) -> bool:
        return True  # (at least one line: asking needs no count)

    def __len__(self) -> int:
        if self.nlines < 0:
            self.nlines = self.data.count(b"\n") + 1
        return self.nlines

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        # The last lines (a tail, a step, a rank's last line) without splitting them all.
        if isinstance(index, int) and index == -1:
            return self.data[self.data.rfind(b"\n") + 1 :]
        if (
            isinstance(index, slice)
            and index.step is None
            and index.stop is None
            and index.start is not None
            and index.start < 0
        ):
            return self.data.rsplit(b"\n", -index.start)[index.start :]
        return self.lines[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.lines)

    def __repr__(self) -> str:
        return f"LineBatch({self.data!r})"


def batch_lines(lines: Sequence[bytes]) -> bytes:
    """Lines joined by ``b"\\n"``: a batch's own bytes, or one join."""
    return lines.data if isinstance(lines, LineBatch) else b"\n".join(lines)


@dataclass(frozen=True)
class RankState:
    """What is known of one rank: where it runs, since when, how it ended."""

    rank: int
    host: str
    role: str
    pid: int
    started: float  # wall-clock time
    status: int | None = None  # exit code, or -N for signal N
    ended: float | None = None
    restarts: int = 0
    stopped: bool = False  # dtrain signalled it (the job was stopping): not a failure of its own


@dataclass(frozen=True)
class RankReport:
    """The first rank that failed: who, where, how, and its last words."""

    rank: int
    host: str
    status: int
    last_lines: tuple[str, ...]
    stream: Stream
    role: str = "worker"
    cause: str | None = None  # what the launcher knows beyond the status (a lost host)
    error: str | None = None  # what torch's @record wrote (TORCHELASTIC_ERROR_FILE): "T: msg"
    error_at: str | None = None  # ...and where it was raised: "train.py:12 in main"


@dataclass(frozen=True)
class JobResult:
    """How a job (or an attempt) ended: its exit code, the ranks' ends, the first failure."""

    exit_code: int
    world_size: int
    elapsed_s: float
    failure: RankReport | None = None
    interrupt: int | None = None
    statuses: dict[int, int | None] = field(default_factory=dict)
    stopped: int = 0  # ranks that were still running and had to be stopped
    sigkilled: int = 0  # ...of which had to be SIGKILLed
    kill_cause: str | None = None  # "after the 5 s grace", "at the second signal"
    failed_hosts: frozenset[str] = frozenset()  # lost, or every rank of it killed unasked
    lost_hosts: frozenset[str] = frozenset()  # ...of which lost: their ranks may still run
    timeout: str | None = None  # a time limit stopped the job: why (exit code 124)
    rescale: str | None = None  # the discovery script's hosts changed: why (restarts at once)
    incomplete: str | None = None  # whose output may be incomplete, and why (not a success)


class OutputSink(Protocol):
    """Where the supervisor sends what happens: output lines and rank states."""

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None: ...

    def update(self, state: RankState) -> None: ...


class PassesTiming:
    """For a sink in front of a view that may hold lines (the collapsing view: outlets'
    ``TimedSink``): when held lines are due, the ticks and the last flush are passed on to
    ``self.timed`` (None: the view holds nothing)."""

    timed: Any

    def next_due(self) -> float | None:
        return self.timed.next_due() if self.timed is not None else None

    def tick(self, now: float | None = None) -> None:
        if self.timed is not None:
            self.timed.tick(now)

    def flush(self) -> None:
        if self.timed is not None:
            self.timed.flush()


def new_tails() -> dict[Stream, deque[bytes]]:
    """A rank's last lines, per stream, for its failure report."""
    return {stream: deque(maxlen=TAIL_LINES) for stream in STREAMS}


def keep_tail(tail: deque[bytes], lines: Iterable[bytes]) -> None:
    tail.extend(line[:TAIL_LINE_BYTES] for line in lines)


def build_rank_report(
    spec: LaunchSpec,
    status: int,
    tails: Mapping[Stream, Sequence[bytes]],
    cause: str | None = None,
) -> RankReport:
    """The failure report of one rank: its last stderr lines, or stdout when stderr is empty.

    A progress bar keeps its final state only: updates (lines a bare ``\\r`` ended) are
    dropped, unless the last line is one (the bar the rank died in).
    """
    stream: Stream = "stderr" if tails.get("stderr") else "stdout"
    lines = list(tails.get(stream, ()))
    kept = [line for line in lines[:-1] if not line.endswith(PROGRESS)] + lines[-1:]
    return RankReport(
        rank=spec.rank,
        host=spec.host.name,
        status=status,
        last_lines=tuple(
            (line[:-1] if line.endswith(PROGRESS) else line).decode("utf-8", "replace")
            for line in kept
        ),
        stream=stream,
        role=spec.role,
        cause=cause,
    )
