"""Fakes for the loop and the job layer: a scripted transport, a recording sink, a clock
whose time jumps (DESIGN.md rule 9: injected, not patched)."""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from launcher.core.command import LaunchSpec
from launcher.core.outcome import OutputSink, RankState, Stream
from launcher.core.plan import Plan

T = TypeVar("T")
Script = tuple[dict[Stream, list[bytes]], int | None, bool]  # output, exit status, ignores TERM


class FakeClock:
    """Virtual time for the supervisor.

    A wait with a deadline first gives the ranks' reader and waiter threads
    ``SETTLE_S`` of real time to post what they have; when nothing comes,
    time jumps to the deadline at once.  A grace period of a minute takes
    ``SETTLE_S``, and the times at which things happened are exact.
    """

    SETTLE_S = 0.3

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start

    def now(self) -> float:
        return self.time

    def wall(self) -> float:
        return 1_700_000_000.0 + self.time

    def take(self, inbox: queue.SimpleQueue[T], timeout: float | None) -> T | None:
        try:
            return inbox.get(timeout=None if timeout is None else self.SETTLE_S)
        except queue.Empty:
            assert timeout is not None
            self.time += max(0.0, timeout)
            return None

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """As ``take``: ``SETTLE_S`` of real time (less for a shorter wait) for the event to
        come, then time jumps to the deadline."""
        if timeout is None:
            return event.wait()
        if event.wait(min(max(0.0, timeout), self.SETTLE_S)):
            return True
        self.time += max(0.0, timeout)
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        """Nothing to wait for: time jumps at once (after letting the other threads run)."""
        time.sleep(0)
        self.time += max(0.0, seconds)


class FakeProcess:
    """Writes its script, then exits with ``status`` (or runs until signalled)."""

    def __init__(
        self,
        spec: LaunchSpec,
        script: Script,
        clock: FakeClock | None = None,
        delay_s: float = 0,
        stuck: bool = False,
    ) -> None:
        output, status, ignores_term = script
        self.spec = spec
        self.stuck = stuck  # its watchdog never exits (a host that stopped answering, say)
        self.pid = 1000 + spec.rank
        self.script = {stream: list(chunks) for stream, chunks in output.items()}
        self.status = status
        self.ignores_term = ignores_term
        self.clock = clock
        self.cause: str | None = None
        self.signals: list[int] = []
        self.signal_times: list[float] = []
        self.exited = threading.Event()
        if status is not None and delay_s:  # exits that much (real) time after its start
            timer = threading.Timer(delay_s, self.exited.set)
            timer.daemon = True
            timer.start()
        elif status is not None:
            self.exited.set()

    def read(self, stream: Stream, size: int) -> bytes:
        chunks = self.script.get(stream, [])
        if chunks:
            return chunks.pop(0)
        self.exited.wait()
        return b""

    def wait(self) -> int:
        self.exited.wait()
        assert self.status is not None
        return self.status

    def gone(self, timeout: float) -> bool:
        if self.stuck:
            time.sleep(timeout)  # as a real watchdog that never exits: the whole wait
            return False
        return self.exited.wait(timeout)

    def dump_stacks(self, timeout: float) -> dict[str, object]:
        return {"error": "a fake process has no stacks"}

    def take_stats(self, timeout: float) -> dict[str, object]:
        return {"error": "a fake process uses nothing"}

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if self.clock is not None:
            self.signal_times.append(self.clock.now())
        if signum == signal.SIGKILL or not self.ignores_term:
            self.status = -signum
            self.exited.set()


class FakeTransport:
    def __init__(
        self,
        scripts: dict[int, Script],
        clock: FakeClock | None = None,
        delays: dict[int, float] | None = None,
        stuck: frozenset[int] = frozenset(),
        lost: Mapping[str, Script] | None = None,
    ) -> None:
        self.scripts = scripts
        self.clock = clock
        self.delays = delays or {}
        self.stuck = stuck  # ranks whose watchdog never exits
        self.lost = lost or {}  # hosts cut off: every rank there runs this script, and is lost
        self.started: dict[int, FakeProcess] = {}
        self.history: list[FakeProcess] = []  # every rank started, restarts included
        self.closed = False

    def start(self, spec: LaunchSpec) -> FakeProcess:
        lost = self.lost.get(spec.host.name)
        process = FakeProcess(
            spec,
            self.scripts[spec.rank] if lost is None else lost,
            self.clock,
            self.delays.get(spec.rank, 0),
            stuck=spec.rank in self.stuck,
        )
        if lost is not None:
            process.cause = f"{spec.host.name} was lost"
        self.started[spec.rank] = process
        self.history.append(process)
        return process

    def close(self) -> None:
        self.closed = True


class RecordingSink:
    def __init__(self) -> None:
        self.lines: list[tuple[int, Stream, bytes]] = []
        self.states: list[RankState] = []

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.lines.extend((spec.rank, stream, line) for line in lines)

    def update(self, state: RankState) -> None:
        self.states.append(state)


class RecordingFrontend:
    """The job's terminal, recorded: the sink it handed out and the notices it got."""

    def __init__(self) -> None:
        self.sink = RecordingSink()
        self.notices: list[str] = []
        self.views: list[tuple[str, int]] = []

    def open_view(
        self, job_id: str, plan: Plan, remote: bool = False, attempt: int = 0
    ) -> tuple[OutputSink, AbstractContextManager[Any]]:
        self.views.append((job_id, plan.world_size))
        return self.sink, contextlib.nullcontext()

    def notice(self, text: str) -> None:
        self.notices.append(text)
