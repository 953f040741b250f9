"""Queries about a running job never hold it up: the hang's stack dump runs off the loop,
each question to an agent gets its own answer, a corrupt agent stream loses its host (and
only that), and a silent client of the control socket blocks nobody."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.base.errors import HostConnectionError
from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, Stream
from launcher.loop.supervisor import Supervisor, TimeLimits
from launcher.remote import agent as agent_program
from launcher.streams.control import ControlServer, ask
from launcher.streams.jobdir import CONTROL_SOCKET
from launcher.transport.agentlink import AgentProcess, HostAgent
from tests.fakes import FakeClock, FakeTransport, RecordingSink

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # generous: what must happen "at once" happens well within it, even under load


def specs(count: int) -> list[LaunchSpec]:
    return [
        LaunchSpec(rank=r, host=Host("h"), local_rank=r, argv=("x",), env={}) for r in range(count)
    ]


@pytest.mark.parametrize("what", ["ctrl-c", "exit"])
def test_a_slow_hang_dump_does_not_hold_up_the_loop(what: str) -> None:
    """The stacks of a hung job take long (a host that does not answer): meanwhile a Ctrl-C
    or a rank's exit is handled at once, and the late stacks are not reported."""
    dumping, release = threading.Event(), threading.Event()
    reported: list[object] = []

    def slow_stacks(timeout_s: float) -> dict[int, tuple[str, dict[str, Any]]]:
        dumping.set()
        release.wait(3 * WAIT_S)  # the old loop waited here, Ctrl-C or not
        return {0: ("h", {"error": "late"})}

    def on_hang(dumps: object) -> str:
        reported.append(dumps)
        return ""

    clock = FakeClock()
    transport = FakeTransport({0: ({}, None, False)}, clock)  # runs until signalled...
    supervisor = Supervisor(
        specs(1), transport, RecordingSink(), handle_signals=False, clock=clock,
        limits=TimeLimits(hang_s=10, on_hang=on_hang), stacks=slow_stacks,
    )  # fmt: skip
    results: list[JobResult] = []
    loop = threading.Thread(target=lambda: results.append(supervisor.run()), daemon=True)
    loop.start()
    try:
        assert dumping.wait(WAIT_S), "the hang was never noticed"
        if what == "ctrl-c":
            supervisor.on_signal(signal.SIGINT)
        else:  # ...or exits, while its stacks are being taken
            rank = transport.started[0]
            rank.status = 0
            rank.exited.set()
        loop.join(WAIT_S)
        assert not loop.is_alive(), "the loop waited for the stack dump"
    finally:
        release.set()
    result = results[0]
    if what == "ctrl-c":
        assert result.exit_code == 130 and result.interrupt == signal.SIGINT
        assert transport.started[0].signals == [signal.SIGTERM]
    else:
        assert result.exit_code == 0 and result.timeout is None
    assert reported == []  # the job ended meanwhile: no hang to report


class AgentOnHand:
    """The real agent program's answering of questions (``remote/agent.py``), in this
    process, as the one host an ``AgentProcess`` asks; its answers are held until the test
    hands them over (a slow host), in the order it likes."""

    RUN = 1

    def __init__(self) -> None:
        self.agent = agent_program.Agent({"py_spy": None})
        self.agent.children[self.RUN] = agent_program.Forked(os.getpid(), None, None, None, None)
        self.agent.send = self.hold  # type: ignore[method-assign]  # (not onto stdout)
        self.held: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()

    def hold(self, run: int, kind: int, payload: bytes) -> None:
        self.held.put((kind, payload))

    def send(self, run: int, kind: int, payload: bytes) -> None:
        """The launcher's frame to the agent."""
        self.agent.handle_frame(run, kind, payload)

    def next_answer(self) -> tuple[int, bytes]:
        return self.held.get(timeout=WAIT_S)


def asked_at(payload: bytes) -> float:
    """When the agent took the figures it answered with (its clock)."""
    reply = json.loads(payload)
    return float(reply.get("answer", reply)["time"])


def rank_asked() -> tuple[AgentProcess, AgentOnHand]:
    host = AgentOnHand()
    return AgentProcess(specs(1)[0], host, AgentOnHand.RUN), host  # type: ignore[arg-type]


def asking(process: AgentProcess, found: list[dict[str, Any]]) -> threading.Thread:
    """An asker (``dtrain top``, say) on a thread of its own."""
    thread = threading.Thread(target=lambda: found.append(process.take_stats(WAIT_S)))
    thread.start()
    return thread


def test_a_late_answer_is_not_taken_for_the_next_question() -> None:
    process, host = rank_asked()
    assert "error" in process.take_stats(0.05)  # no answer in time: the asker gave up
    late = host.next_answer()
    found: list[dict[str, Any]] = []
    second = asking(process, found)
    answer = host.next_answer()
    process.receive(*late)  # the first question's answer comes, late, while the second waits
    second.join(0.5)  # (the time it took the old asker to take the late answer for its own)
    assert found == []  # still waiting for its own
    process.receive(*answer)
    second.join(WAIT_S)
    assert found and found[0].get("time") == asked_at(answer[1]), found


def test_two_askers_of_the_same_kind_each_get_their_own_answer() -> None:
    """(The hang's stack dump and ``dtrain stacks`` at the same time, say.)"""
    process, host = rank_asked()
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    askers = [asking(process, first)]
    answer_first = host.next_answer()
    askers.append(asking(process, second))
    answer_second = host.next_answer()
    process.receive(*answer_second)  # answered in the other order
    process.receive(*answer_first)
    for asker in askers:
        asker.join(WAIT_S)
    assert first and first[0].get("time") == asked_at(answer_first[1]), first
    assert second and second[0].get("time") == asked_at(answer_second[1]), second


class ScriptedChannel:
    """An agent's channel (``AgentChannel``) that gives the chunks scripted, then its end."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.closed = False
        self.received = 0  # bytes the launcher took from it
        self.sent: list[bytes] = []

    def sendall(self, data: bytes, /) -> None:
        self.sent.append(data)

    def settimeout(self, timeout: float | None, /) -> None:
        pass

    def recv(self, size: int, /) -> bytes:
        chunk = b"" if self.closed else next(self.chunks, b"")
        self.received += len(chunk)
        return chunk

    def recv_stderr_ready(self) -> bool:
        return False

    def recv_stderr(self, size: int, /) -> bytes:
        return b""

    def close(self) -> None:
        self.closed = True


class ScriptedLink:
    """The way into host ``node9`` (``HostLink``): only its name is asked."""

    host = Host("node9")

    def open_channel(self, command: str, timeout_s: float) -> ScriptedChannel:
        raise AssertionError("not opened: the channel is given")

    def agent_failed(self, last: str) -> HostConnectionError:
        return HostConnectionError(last)

    def close(self) -> None:
        pass


def demultiplexed(
    chunks: Iterator[bytes], ranks: int = 2
) -> tuple[list[AgentProcess], ScriptedChannel]:
    """``ranks`` ranks started on node9, its agent's stream read to its end (in the
    demultiplexer's own thread, as in a job)."""
    channel = ScriptedChannel(chunks)
    host = HostAgent(ScriptedLink(), channel)
    processes = [host.start(spec, 5.0, None) for spec in specs(ranks)]
    reader = threading.Thread(target=host.demultiplex, daemon=True)
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive()
    return processes, channel


def test_a_malformed_frame_loses_the_host_with_its_cause() -> None:
    frames = [
        agent_program.encode(1, agent_program.STARTED, b"4242"),
        agent_program.encode(2, agent_program.STARTED, b"not a pid"),  # (an agent's bug)
        agent_program.encode(1, agent_program.STDOUT, b"never read\n"),
    ]
    processes, channel = demultiplexed(iter(frames))
    for process in processes:  # the host is lost: its ranks end, and the summary says why
        assert process.exited.is_set()
        assert "node9" in (process.cause or "") and "malformed" in (process.cause or "")
    assert channel.closed  # (the agent then ends what runs there)


def test_an_oversized_frame_is_an_error_not_unbounded_memory() -> None:
    def corrupt() -> Iterator[bytes]:
        yield agent_program.HEADER.pack(1, agent_program.STDOUT, 1 << 31)  # 2 GiB "coming"
        for _ in range(256):  # 64 MiB (the old launcher took it all, waiting for 2 GiB)
            yield bytes(1 << 18)

    processes, channel = demultiplexed(corrupt())
    assert channel.received < 1 << 20  # read no further than the header's chunk or so
    for process in processes:
        assert process.exited.is_set()
        assert "malformed" in (process.cause or "") and "node9" in (process.cause or "")


class Restarting:
    """A rank's feed that restarts the rank (the supervisor would, in its thread) as soon as
    it hears of its exit."""

    def __init__(self, restart: Callable[[], object]) -> None:
        self.restart = restart

    def feed(self, stream: Stream, data: bytes) -> None:
        pass

    def began(self) -> None:
        pass

    def exited(self, status: int) -> None:
        self.restart()


def test_a_rank_restarted_while_its_host_is_lost_is_lost_too() -> None:
    """A restart inserting its run while the demultiplexer ends every rank of a lost host:
    no rank of the host is left running (the job would wait for it forever)."""
    restarted: list[AgentProcess] = []
    channel = ScriptedChannel(iter(()))  # the connection ends at once
    host = HostAgent(ScriptedLink(), channel)
    processes = [host.start(spec, 5.0, None) for spec in specs(3)]
    processes[0].attach(Restarting(lambda: restarted.append(host.start(specs(1)[0], 5.0, None))))
    host.demultiplex()
    assert restarted
    for process in [*processes, *restarted]:
        assert process.exited.is_set() and "node9" in (process.cause or "")


def test_a_silent_client_of_the_control_socket_blocks_no_other(tmp_path: Path) -> None:
    server = ControlServer(tmp_path / CONTROL_SOCKET, lambda request: {"op": request.get("op")})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(tmp_path / CONTROL_SOCKET))  # connects, and says nothing
            assert ask(tmp_path, {"op": "stacks"}, WAIT_S) == {"op": "stacks"}
            assert ask(tmp_path, {"op": "stats"}, WAIT_S) == {"op": "stats"}
    finally:
        server.close()


def test_a_silent_client_is_dropped_after_the_client_timeout(tmp_path: Path) -> None:
    server = ControlServer(tmp_path / CONTROL_SOCKET, lambda request: {}, client_timeout_s=0.2)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(tmp_path / CONTROL_SOCKET))
            silent.settimeout(WAIT_S)
            assert silent.recv(1) == b""  # the launcher hung up: no thread of it waits on us
    finally:
        server.close()
