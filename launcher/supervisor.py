"""The only loop (DESIGN.md): start every rank, pump its output, apply the policy, tear down.

Reader and waiter threads turn each rank's streams and exit into events on
one queue; the loop in ``Supervisor.run`` (the main thread) takes them one by
one, shows lines through the injected sink, feeds exits and signals to
``policy.decide`` and carries out the action.  Teardown (SIGTERM to every
process group, the grace period, then SIGKILL) runs from ``finally`` too, so
no rank outlives the launcher whatever happened in between.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import BinaryIO, Protocol

from launcher.command import LaunchSpec
from launcher.logs import pump_stream, strip_progress
from launcher.policy import (
    Event,
    Finish,
    GraceExpired,
    Interrupted,
    JobState,
    KillAll,
    RankExited,
    Restart,
    StopAll,
    decide,
    start_state,
)
from launcher.transport.base import Process, Stream, Transport

TAIL_LINES = 20
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for exits we may never see
DRAIN_S = 2.0  # after the last exit, how long output may still trickle in
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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


class OutputSink(Protocol):
    """Where the supervisor sends what happens: output lines and rank states."""

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None: ...

    def update(self, state: RankState) -> None: ...


class Tee:
    """One sink made of several (the job directory and the terminal, say)."""

    def __init__(self, *sinks: OutputSink) -> None:
        self.sinks = sinks

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        for sink in self.sinks:
            sink.show(spec, stream, lines)

    def update(self, state: RankState) -> None:
        for sink in self.sinks:
            sink.update(state)


@dataclass(frozen=True)
class RankReport:
    """The first rank that failed: who, where, how, and its last words."""

    rank: int
    host: str
    status: int
    last_lines: tuple[str, ...]
    stream: Stream
    role: str = "worker"


@dataclass(frozen=True)
class JobResult:
    exit_code: int
    world_size: int
    elapsed_s: float
    failure: RankReport | None = None
    interrupt: int | None = None
    statuses: dict[int, int | None] = field(default_factory=dict)


@dataclass(eq=False)
class RankTrack:
    """One run of one rank (a restart is a new track)."""

    spec: LaunchSpec
    process: Process
    state: RankState
    open_streams: int = 2
    status: int | None = None
    tails: dict[Stream, deque[bytes]] = field(
        default_factory=lambda: {s: deque(maxlen=TAIL_LINES) for s in STREAMS}
    )


@dataclass(frozen=True)
class Output:
    track: RankTrack
    stream: Stream
    lines: list[bytes]


@dataclass(frozen=True)
class StreamEnd:
    track: RankTrack


@dataclass(frozen=True)
class Exit:
    track: RankTrack
    status: int


@dataclass(frozen=True)
class Signalled:
    signum: int


Message = Output | StreamEnd | Exit | Signalled


class Supervisor:
    def __init__(
        self,
        specs: Sequence[LaunchSpec],
        transport: Transport,
        sink: OutputSink,
        *,
        grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        output_dir: Path | None = None,
        handle_signals: bool = True,
        roles: Mapping[int, str] | None = None,
        worker_restarts: int = 0,
    ) -> None:
        self.specs = list(specs)
        self.transport = transport
        self.sink = sink
        self.grace_s = grace_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.output_dir = output_dir
        self.handle_signals = handle_signals
        self.roles = roles
        self.worker_restarts = worker_restarts
        self.retired: list[RankTrack] = []  # earlier runs of restarted ranks
        self.events: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.tracks: dict[int, RankTrack] = {}
        self.stop_requested = False
        self.killed = False

    # -- the loop ---------------------------------------------------------

    def run(self) -> JobResult:
        started = self.clock()
        previous = self.install_signal_handlers()
        state = start_state(frozenset())
        try:
            for spec in self.specs:
                if self.stop_requested:
                    break  # Ctrl-C during start-up: start no more ranks
                self.start(spec)
            state = start_state(frozenset(self.tracks), self.roles, self.worker_restarts)
            state = self.loop(state)
            self.drain()
        finally:
            self.teardown()
            self.restore_signal_handlers(previous)
            self.transport.close()
        return JobResult(
            exit_code=state.exit_code,
            world_size=len(self.specs),
            elapsed_s=self.clock() - started,
            failure=self.report(state.failure.rank) if state.failure else None,
            interrupt=state.interrupt,
            statuses={r: t.status for r, t in self.tracks.items()},
        )

    def loop(self, state: JobState) -> JobState:
        deadline: float | None = None  # grace or kill deadline, when stopping
        while True:
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            event = self.next_event(timeout)
            if event is None:
                if state.killing:
                    return state  # SIGKILLed ranks that never reported back: give up on them
                event = GraceExpired()
            state, action = decide(state, event)
            if isinstance(action, Finish):
                return state
            if isinstance(action, Restart):
                self.restart(action.rank)
            elif isinstance(action, StopAll):
                self.signal_running(signal.SIGTERM)
                deadline = self.clock() + self.grace_s
            elif isinstance(action, KillAll):
                self.signal_running(signal.SIGKILL)
                deadline = self.clock() + KILL_WAIT_S

    def next_event(self, timeout: float | None) -> Event | None:
        """Handle queued output until an event for the policy arrives (None: timed out)."""
        end = None if timeout is None else self.clock() + timeout
        while True:
            wait = 0.5 if end is None else min(0.5, end - self.clock())
            if wait <= 0:
                return None
            try:
                message = self.events.get(timeout=wait)
            except queue.Empty:
                continue
            event = self.handle(message)
            if event is not None:
                return event

    def handle(self, message: Message) -> Event | None:
        """Show output, count closed streams; exits and signals become policy events."""
        if isinstance(message, Signalled):
            return Interrupted(message.signum)
        track = message.track
        if isinstance(message, Output):
            track.tails[message.stream].extend(message.lines)
            self.sink.show(track.spec, message.stream, message.lines)
        elif isinstance(message, StreamEnd):
            track.open_streams -= 1
        else:
            track.status = message.status
            track.state = replace(track.state, status=message.status, ended=self.wall_clock())
            self.sink.update(track.state)
            return RankExited(track.spec.rank, message.status)
        return None

    def drain(self) -> None:
        """Show what the ranks wrote before they exited.

        Waits up to ``DRAIN_S`` for streams to close (a process that escaped
        everything may hold one open), but never drops what was already read.
        """
        end = self.clock() + DRAIN_S
        tracks = [*self.tracks.values(), *self.retired]
        while any(t.open_streams for t in tracks) and self.clock() < end:
            try:
                message = self.events.get(timeout=max(0.0, end - self.clock()))
            except queue.Empty:
                break
            self.handle(message)
        while True:
            try:
                message = self.events.get_nowait()
            except queue.Empty:
                return
            self.handle(message)

    # -- starting and stopping ranks ---------------------------------------

    def start(self, spec: LaunchSpec, restarts: int = 0) -> None:
        process = self.transport.start(spec)
        state = RankState(
            spec.rank, spec.host.name, spec.role, process.pid, self.wall_clock(), restarts=restarts
        )
        track = self.tracks[spec.rank] = RankTrack(spec, process, state)
        self.sink.update(state)
        for stream in STREAMS:
            copy = self.open_copy(spec.rank, stream, append=restarts > 0)
            threading.Thread(target=self.pump, args=(track, stream, copy), daemon=True).start()
        threading.Thread(target=self.wait_for, args=(track,), daemon=True).start()

    def restart(self, rank: int) -> None:
        """Start a rank again in place: same spec, same environment, one more restart."""
        old = self.tracks[rank]
        self.retired.append(old)
        self.start(old.spec, restarts=old.state.restarts + 1)

    def pump(self, track: RankTrack, stream: Stream, copy: BinaryIO | None) -> None:
        def on_lines(lines: list[bytes]) -> None:
            self.events.put(Output(track, stream, lines))

        pump_stream(lambda size: track.process.read(stream, size), on_lines, copy)
        self.events.put(StreamEnd(track))

    def wait_for(self, track: RankTrack) -> None:
        self.events.put(Exit(track, track.process.wait()))

    def open_copy(self, rank: int, stream: Stream, append: bool) -> BinaryIO | None:
        if self.output_dir is None:
            return None
        directory = self.output_dir / f"rank.{rank}"
        directory.mkdir(parents=True, exist_ok=True)
        return open(directory / stream, "ab" if append else "wb")  # a restart appends

    def signal_running(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.killed = True
        for track in self.tracks.values():
            if track.status is None:
                track.process.signal(signum)

    def teardown(self) -> None:
        """SIGTERM, grace, SIGKILL for whatever still runs (after an error in the loop).

        Only exits are recorded here (output is no longer shown: the view may
        be what failed), and a signal to dtrain cuts the grace short.
        """
        if self.killed or all(t.status is not None for t in self.tracks.values()):
            return
        try:
            self.signal_running(signal.SIGTERM)
            end = self.clock() + self.grace_s
            while self.clock() < end and any(t.status is None for t in self.tracks.values()):
                try:
                    message = self.events.get(timeout=max(0.01, min(0.5, end - self.clock())))
                except queue.Empty:
                    continue
                if isinstance(message, Signalled):
                    break
                if isinstance(message, Exit):
                    message.track.status = message.status
        finally:
            self.signal_running(signal.SIGKILL)

    # -- signals and the report --------------------------------------------

    def install_signal_handlers(self) -> dict[int, object]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.stop_requested = True
            self.events.put(Signalled(signum))

        return {s: signal.signal(s, on_signal) for s in HANDLED_SIGNALS}

    def restore_signal_handlers(self, previous: dict[int, object]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def report(self, rank: int) -> RankReport:
        track = self.tracks[rank]
        stream: Stream = "stderr" if track.tails["stderr"] else "stdout"
        return RankReport(
            rank=rank,
            host=track.spec.host.name,
            status=track.status if track.status is not None else -signal.SIGKILL,
            last_lines=tuple(
                strip_progress(line).decode("utf-8", "replace") for line in track.tails[stream]
            ),
            stream=stream,
            role=track.spec.role,
        )
