"""One run of one rank (loop layer): its process, a reader per stream, a waiter, its tails.

The readers hand whole lines to the outlets (``outlets.Fanout``: the job
directory and the view, each with its own writer), keeping the last ones for
the failure report.  When the rank's share of an outlet is full, its reader
stops reading it until there is room (``feed`` says so to the transport's
reader, which goes on with the other ranks; a reader of this stream alone
waits), and so does the rank (back-pressure), never the supervisor.  A rank
held back so is not silent (``heard``).  The ends of streams and the exit go
to the supervisor's inbox as messages.  A restarted rank is a new ``RankRun``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeGuard

from launcher.core.command import LaunchSpec
from launcher.core.outcome import STREAMS, RankState, Stream, keep_tail, new_tails
from launcher.streams.lines import LinePump, LineSink, pump_stream
from launcher.streams.outlets import Fanout
from launcher.transport.base import AttachableProcess, LateStartingProcess, Process


@dataclass(frozen=True)
class StreamEnd:
    run: RankRun


@dataclass(frozen=True)
class Exit:
    run: RankRun
    status: int
    time: float  # wall clock, the moment the status was known


@dataclass(frozen=True)
class Started:
    """A remote rank's pid is known (its agent started it)."""

    run: RankRun


@dataclass(frozen=True)
class Signalled:
    signum: int


Message = StreamEnd | Started | Exit | Signalled


class RankRun:
    """A started rank: what it said last (per stream), whether its streams are open, its status."""

    def __init__(
        self,
        spec: LaunchSpec,
        process: Process,
        state: RankState,
        post: Callable[[Message], None],
        output: Fanout,
        wall: Callable[[], float],
        now: Callable[[], float] | None = None,
    ) -> None:
        self.spec = spec
        self.process = process
        self.state = state
        self.post = post
        self.output = output
        self.wall = wall
        self.open_streams = len(STREAMS)
        self.status: int | None = None
        self.tails: dict[Stream, deque[bytes]] = new_tails()
        self.now = now or wall
        self.last_output = self.now()  # when it last printed (--hang-timeout, dtrain top)
        self.last_data = self.last_output  # when a chunk of a stream last came (the drain)
        self.holds = 0  # its streams not read now: an outlet's share of it is full
        self.holds_lock = threading.Lock()
        self.cut: dict[Stream, str] = {}  # streams that ended without their end: why
        self.last_line = b""
        self.started = not is_late_starting(process)  # told later (``Started``)
        self.pumps: dict[Stream, LinePump] = {}  # the streams' framing, when fed (``attach``)

    def watch(self, output_dir: Path | None, append: bool = False) -> None:
        """Have the streams read and the exit awaited: by the transport's own threads where
        its process can be attached (``feed``, ``began``, ``exited``), else by a reader per
        stream and a waiter.  ``output_dir`` gets raw copies of the streams (not of a
        launcher's, mpirun's: its lines are copied per rank once split, ``RankLauncher``)."""
        append = append or self.state.restarts > 0  # a restart appends to earlier runs' copies
        output_dir = None if self.spec.label else output_dir
        copies = {s: open_copy(output_dir, self.spec.rank, s, append) for s in STREAMS}
        if is_attachable(self.process):
            self.pumps = {s: LinePump(self.lines_of(s), copies[s]) for s in STREAMS}
            self.process.attach(self)
            return
        for stream in STREAMS:
            threading.Thread(target=self.pump, args=(stream, copies[stream]), daemon=True).start()
        threading.Thread(target=self.wait, daemon=True).start()

    def lines_of(self, stream: Stream) -> LineSink:
        tail = self.tails[stream]
        keep = tail.maxlen or 0  # a batch's last lines only: the tail keeps no more

        def on_lines(lines: Sequence[bytes]) -> None:
            self.last_output = self.now()
            self.last_line = lines[-1]
            keep_tail(tail, lines[-keep:])  # (a batch's last lines, without splitting it all)
            self.output.post_lines(self.spec, stream, lines)

        return on_lines

    def pump(self, stream: Stream, copy: BinaryIO | None) -> None:
        """A reader of this stream alone: it waits while the outlets are full."""
        post = self.lines_of(stream)

        def read(size: int) -> bytes:
            data = self.process.read(stream, size)
            self.last_data = self.now()
            return data

        def on_lines(lines: Sequence[bytes]) -> None:
            post(lines)
            self.wait_for_room()

        pump_stream(read, on_lines, copy)
        self.post(StreamEnd(self))

    def heard(self, now: float) -> float:
        """When it was last heard of: ``now`` while dtrain itself holds it back (a full
        outlet: a paused terminal), which is not silence; else when it last printed."""
        return now if self.holds else self.last_output

    def has_room(self, on_room: Callable[[], None]) -> bool:
        """True: the outlets take more of this rank now.  False: its reader stops reading
        it until ``on_room`` is called (meanwhile the rank counts as heard)."""
        with self.holds_lock:
            self.holds += 1

        def resume() -> None:
            self.release(self.now())  # held until now: silence counts from now
            on_room()

        if self.output.when_room(self.spec, resume):
            self.release(None)
            return True
        return False

    def release(self, heard: float | None) -> None:
        with self.holds_lock:
            self.holds -= 1
            if heard is not None:
                self.last_output = max(self.last_output, heard)

    def wait_for_room(self) -> None:
        room = threading.Event()
        if not self.has_room(room.set):
            room.wait()

    # -- fed by the transport (``attach``) ---------------------------------

    def feed(self, stream: Stream, data: bytes, on_room: Callable[[], None] | None = None) -> bool:
        """A chunk (b"": the end) of a stream.  True: feed more.  False: the outlets are
        full; feed no more of this rank until ``on_room`` is called.  Without ``on_room``
        (a feeder that cannot hold a rank back) this waits until there is room."""
        self.last_data = self.now()
        pump = self.pumps[stream]
        if data:
            pump.feed(data)
            if on_room is None:
                self.wait_for_room()
                return True
            return self.has_room(on_room)
        try:
            pump.finish()
        finally:
            self.post(StreamEnd(self))
        return True

    def cut_off(self, stream: Stream, cause: str) -> None:
        """The stream ended without its end (its host was lost): what came is kept, and
        the rest may be missing."""
        self.cut[stream] = cause
        self.feed(stream, b"")

    def began(self) -> None:
        self.post(Started(self))

    def exited(self, status: int) -> None:
        self.post(Exit(self, status, self.wall()))

    def wait(self) -> None:
        if is_late_starting(self.process):  # a remote rank's pid comes later
            self.process.started.wait()
            self.post(Started(self))
        status = self.process.wait()
        self.post(Exit(self, status, self.wall()))

    @property
    def running(self) -> bool:
        return self.status is None


# isinstance() against a runtime-checkable Protocol collects the protocol's members again on
# every call (typing's __instancecheck__, some 100 us): for thousands of ranks, seconds of
# the loop's start.  Both protocols here have one member, looked at directly.


def is_late_starting(process: object) -> TypeGuard[LateStartingProcess]:
    """``isinstance(process, LateStartingProcess)``, without typing's cost."""
    return hasattr(process, "started")


def is_attachable(process: object) -> TypeGuard[AttachableProcess]:
    """``isinstance(process, AttachableProcess)``, without typing's cost."""
    return getattr(process, "attach", None) is not None


def open_copy(output_dir: Path | None, rank: int, stream: Stream, append: bool) -> BinaryIO | None:
    """``--output-dir``: DIR/rank.N/stdout and stderr, raw bytes as the rank wrote them."""
    if output_dir is None:
        return None
    directory = output_dir / f"rank.{rank}"
    directory.mkdir(parents=True, exist_ok=True)
    return open(directory / stream, "ab" if append else "wb")  # the pump closes it
