"""The supervisor loop against a scripted fake transport (no processes)."""

from __future__ import annotations

import signal
import threading

from launcher.command import LaunchSpec
from launcher.hosts import Host
from launcher.supervisor import JobResult, RankReport, RankState, Signalled, Supervisor
from launcher.transport.base import Stream


class FakeProcess:
    """Writes its script, then exits with ``status`` (or runs until signalled)."""

    def __init__(
        self,
        spec: LaunchSpec,
        script: dict[Stream, list[bytes]],
        status: int | None,
        ignores_term: bool = False,
    ) -> None:
        self.spec = spec
        self.pid = 1000 + spec.rank
        self.script = {stream: list(chunks) for stream, chunks in script.items()}
        self.status = status
        self.ignores_term = ignores_term
        self.signals: list[int] = []
        self.exited = threading.Event()
        if status is not None:
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

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGKILL or not self.ignores_term:
            self.status = -signum
            self.exited.set()


class FakeTransport:
    def __init__(
        self, plans: dict[int, tuple[dict[Stream, list[bytes]], int | None, bool]]
    ) -> None:
        self.plans = plans
        self.started: dict[int, FakeProcess] = {}
        self.closed = False

    def start(self, spec: LaunchSpec) -> FakeProcess:
        script, status, ignores_term = self.plans[spec.rank]
        process = FakeProcess(spec, script, status, ignores_term)
        self.started[spec.rank] = process
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


def specs(count: int) -> list[LaunchSpec]:
    return [
        LaunchSpec(rank=r, host=Host("h"), local_rank=r, argv=("x",), env={}) for r in range(count)
    ]


def supervise(
    plans: dict[int, tuple[dict[Stream, list[bytes]], int | None, bool]], grace_s: float = 5.0
) -> tuple[JobResult, FakeTransport, RecordingSink]:
    transport, sink = FakeTransport(plans), RecordingSink()
    result = Supervisor(
        specs(len(plans)), transport, sink, grace_s=grace_s, handle_signals=False
    ).run()
    return result, transport, sink


def test_success_shows_every_line_and_exits_zero() -> None:
    result, transport, sink = supervise(
        {
            0: ({"stdout": [b"a\nb", b"c\n"], "stderr": [b"warn\n"]}, 0, False),
            1: ({"stdout": [b"d\n"]}, 0, False),
        }
    )
    assert result.exit_code == 0 and result.failure is None
    assert result.statuses == {0: 0, 1: 0}
    per_stream = {
        key: [line for rank, stream, line in sink.lines if (rank, stream) == key]
        for key in [(0, "stdout"), (0, "stderr"), (1, "stdout")]
    }
    assert per_stream == {
        (0, "stdout"): [b"a", b"bc"],
        (0, "stderr"): [b"warn"],
        (1, "stdout"): [b"d"],
    }
    assert transport.closed


def test_failure_stops_the_others_and_reports_the_first() -> None:
    result, transport, _ = supervise(
        {
            0: ({}, None, False),
            1: ({"stderr": [b"line 1\nTraceback\nValueError: bad\n"]}, 3, False),
            2: ({}, None, False),
        }
    )
    assert result.exit_code == 3
    assert result.failure == RankReport(
        rank=1,
        host="h",
        status=3,
        last_lines=("line 1", "Traceback", "ValueError: bad"),
        stream="stderr",
    )
    assert transport.started[0].signals == [signal.SIGTERM]
    assert transport.started[2].signals == [signal.SIGTERM]
    assert transport.started[1].signals == []


def test_rank_ignoring_sigterm_gets_sigkill_after_grace() -> None:
    result, transport, _ = supervise(
        {
            0: ({"stdout": [b"bye\n"]}, 1, False),
            1: ({}, None, True),
        },
        grace_s=0.2,
    )
    assert result.exit_code == 1
    assert transport.started[1].signals == [signal.SIGTERM, signal.SIGKILL]
    assert result.statuses[1] == -signal.SIGKILL
    assert result.failure is not None and result.failure.last_lines == ("bye",)


def test_interrupt_stops_gracefully_then_second_kills() -> None:
    transport, sink = FakeTransport({0: ({}, None, True), 1: ({}, None, True)}), RecordingSink()
    supervisor = Supervisor(specs(2), transport, sink, grace_s=60, handle_signals=False)
    supervisor.events.put(Signalled(signal.SIGINT))
    supervisor.events.put(Signalled(signal.SIGINT))
    result = supervisor.run()
    assert result.exit_code == 130 and result.interrupt == signal.SIGINT
    assert transport.started[0].signals == [signal.SIGTERM, signal.SIGKILL]
    assert result.statuses == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


def test_interrupt_before_start_starts_nothing_more() -> None:
    transport, sink = FakeTransport({0: ({}, None, False), 1: ({}, None, False)}), RecordingSink()
    supervisor = Supervisor(specs(2), transport, sink, grace_s=5, handle_signals=False)
    supervisor.stop_requested = True
    supervisor.events.put(Signalled(signal.SIGTERM))
    result = supervisor.run()
    assert transport.started == {}
    assert result.exit_code == 143
