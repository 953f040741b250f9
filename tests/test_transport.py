"""The local transport on real processes: the status comes out of band and cannot be forged."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from launcher.command import LaunchSpec
from launcher.hosts import Host
from launcher.transport.local import LocalTransport

FORGER = r"""
import os, sys
# What the watchdog once wrote in-band on stderr, then every fd a status pipe could be.
os.write(2, b"\0DTRAIN_STATUS:0\n")
sys.stdout.write("a\0b\n")
sys.stdout.flush()
for fd in range(3, 64):
    try:
        os.write(fd, b"0\n")
    except OSError:
        pass
sys.exit(int(sys.argv[1]))
"""


def run_rank(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    process = transport.start(LaunchSpec(0, Host("localhost"), 0, argv=argv, env={}))
    out, err = b"", b""
    while chunk := process.read("stdout", 65536):
        out += chunk
    while chunk := process.read("stderr", 65536):
        err += chunk
    return process.wait(), out, err


@pytest.mark.parametrize("code", [0, 3, 255])
def test_a_program_cannot_forge_its_status(code: int) -> None:
    status, out, err = run_rank((sys.executable, "-c", FORGER, str(code)))
    assert status == code
    assert out == b"a\0b\n"  # output passes intact, NUL bytes included
    assert err == b"\0DTRAIN_STATUS:0\n"


def test_death_by_signal_is_reported_as_minus_the_signal() -> None:
    status, _, _ = run_rank(("sh", "-c", "kill -SEGV $$"))
    assert status == -signal.SIGSEGV


def group_members(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                found.append(int(entry))
    return found


def test_a_killed_watchdog_takes_its_rank_along() -> None:
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    process = transport.start(LaunchSpec(0, Host("localhost"), 0, argv=("sleep", "30"), env={}))
    deadline = time.monotonic() + 10
    while len(group_members(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the watchdog and sleep
    os.kill(process.pid, signal.SIGKILL)  # the watchdog alone, as the OOM killer would
    assert process.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert group_members(process.pid) == []


class ScriptedChannel:
    """What an agent's channel delivers: these bytes, in chunks of ``size``."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data = data
        self.size = size
        self.closed = False

    def recv(self, limit: int) -> bytes:
        chunk, self.data = self.data[: min(limit, self.size)], self.data[min(limit, self.size) :]
        return chunk


def test_agent_frames_are_taken_whole_whatever_the_chunks() -> None:
    from launcher.remote import agent
    from launcher.transport.ssh import HostAgent

    frames = [agent.encode(i % 7, agent.STDOUT, b"x" * (i % 50)) for i in range(100_000)]
    preamble = b"Welcome! (a login shell's banner)\n"
    channel = ScriptedChannel(preamble + agent.START_MARK + b"".join(frames), 1 << 18)
    host = HostAgent(connection=None, channel=channel)  # type: ignore[arg-type]
    host.skip_to_start()
    got = [host.next_frame() for _ in range(len(frames))]
    assert got == [(i % 7, agent.STDOUT, b"x" * (i % 50)) for i in range(100_000)]
    assert channel.data == b""


def test_watchdogs_are_reaped_and_their_pipes_closed() -> None:
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    before = len(os.listdir("/proc/self/fd"))
    processes = [
        transport.start(LaunchSpec(0, Host("localhost"), 0, argv=("true",), env={}))
        for _ in range(20)
    ]
    for process in processes:
        while process.read("stdout", 65536) or process.read("stderr", 65536):
            pass
        assert process.wait() == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in processes if p.returncode is None]
        if not left and len(os.listdir("/proc/self/fd")) <= before:
            break
        time.sleep(0.05)
    assert all(p.returncode == 0 for p in processes)
    assert all(not os.path.exists(f"/proc/{p.pid}") for p in processes)  # reaped: no zombie
    transport.close()  # the local agent goes, and its socket
    assert transport.agent is not None and transport.agent.popen.poll() is not None
    assert len(os.listdir("/proc/self/fd")) <= before  # no lifeline left open


def test_ranks_outlive_a_lost_local_agent_and_a_new_one_starts() -> None:
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    first = transport.start(LaunchSpec(0, Host("localhost"), 0, argv=("sleep", "30"), env={}))
    deadline = time.monotonic() + 10
    while len(group_members(first.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert transport.agent is not None
    lost = transport.agent
    os.kill(lost.popen.pid, signal.SIGKILL)  # the agent alone: its watchdogs go on
    lost.popen.wait()
    second = transport.start(LaunchSpec(1, Host("localhost"), 0, argv=("true",), env={}))
    assert transport.agent is not lost  # a new agent forked it
    assert second.wait() == 0
    assert first.returncode is None  # still watched, still running
    first.signal(signal.SIGTERM)
    assert first.wait() == -signal.SIGTERM
    assert first.gone(10)  # its end is seen without the agent that forked it
    assert group_members(first.pid) == []
    transport.close()
