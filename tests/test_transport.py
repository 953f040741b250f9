"""The local transport on real processes: the status comes out of band and cannot be forged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.transport.feeds import PipeReader, Pump
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
    from launcher.transport.agentlink import HostAgent

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


class Recorder:
    """A ``RankFeed`` that keeps what it is fed; ``hold`` makes feeding wait (a paused view)."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.status: int | None = None
        self.exited_at: float | None = None
        self.ended = threading.Event()
        self.hold = hold

    def feed(self, stream: str, data: bytes, on_room: Callable[[], None] | None = None) -> bool:
        if self.hold is not None:
            self.hold.wait()
        self.chunks[stream].append(data)
        if all(c and c[-1] == b"" for c in self.chunks.values()):
            self.ended.set()
        return True

    def cut_off(self, stream: str, cause: str) -> None:
        self.feed(stream, b"")

    def began(self) -> None:
        pass

    def exited(self, status: int) -> None:
        self.status, self.exited_at = status, time.monotonic()


def test_attached_ranks_are_read_by_two_threads_whole_and_in_order() -> None:
    """Twenty attached ranks: every byte of every stream, in order, ended once; the statuses;
    two reader threads in all (not three per rank), gone once the transport is closed."""
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    program = (
        "import sys; [print(f'{sys.argv[1]} {i}') for i in range(20000)]; "
        "sys.exit(int(sys.argv[1]) % 3)"
    )
    threads_before = set(threading.enumerate())  # (an earlier test's may still be ending)

    def new_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in threads_before]

    feeds = []
    for rank in range(20):
        process = transport.start(
            LaunchSpec(
                rank, Host("localhost"), 0, argv=(sys.executable, "-c", program, str(rank)), env={}
            )
        )
        feeds.append(Recorder())
        process.attach(feeds[-1])  # type: ignore[arg-type]
    for rank, feed in enumerate(feeds):
        assert feed.ended.wait(30)
        out = b"".join(feed.chunks["stdout"])
        assert out == b"".join(b"%d %d\n" % (rank, i) for i in range(20000))
        assert feed.chunks["stdout"].count(b"") == 1 and feed.chunks["stderr"] == [b""]
    deadline = time.monotonic() + 10
    while any(f.status is None for f in feeds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [f.status for f in feeds] == [rank % 3 for rank in range(20)]
    # the agent's listener and the two readers (the pipes' reader may be ending already)
    assert len(new_threads()) <= 3, new_threads()
    transport.close()
    deadline = time.monotonic() + 10
    while new_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert new_threads() == []


def test_an_exit_is_told_while_output_waits() -> None:
    """The kill path never waits on output: with feeding held (a paused terminal), the rank's
    exit is still told at once."""
    transport = LocalTransport(dict(os.environ), grace_s=1.0)
    hold = threading.Event()
    feed = Recorder(hold)
    process = transport.start(
        LaunchSpec(0, Host("localhost"), 0, argv=("sh", "-c", "echo out; exit 5"), env={})
    )
    process.attach(feed)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while feed.status is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert feed.status == 5 and feed.chunks["stdout"] == []  # told; the output still held
    hold.set()
    assert feed.ended.wait(10) and feed.chunks["stdout"][0] == b"out\n"
    transport.close()


def test_a_pipe_reader_feeds_each_pipe_in_order_and_survives_a_failing_callback() -> None:
    reader = PipeReader("test-reader")
    got: dict[int, list[bytes]] = {}
    pipes = [os.pipe() for _ in range(5)]

    def callback(index: int) -> Callable[[bytes], None]:
        def take(data: bytes) -> None:
            got.setdefault(index, []).append(data)
            if index == 0 and data:
                raise RuntimeError("this rank's sink broke")

        return take

    for index, (r, _) in enumerate(pipes):
        reader.add(r, callback(index))
    for round_ in range(50):
        for index, (_, w) in enumerate(pipes):
            os.write(w, b"%d:%d\n" % (index, round_))
    for _, w in pipes:
        os.close(w)
    reader.close()
    assert reader.thread is not None
    reader.thread.join(10)
    assert not reader.thread.is_alive()  # every pipe ended, then it did
    for index in range(5):
        assert got[index][-1] == b"" and got[index].count(b"") == 1
        assert b"".join(got[index]) == b"".join(b"%d:%d\n" % (index, i) for i in range(50))
    for r, _ in pipes:
        os.close(r)


def test_a_pump_runs_its_calls_in_order_then_ends() -> None:
    pump = Pump("test-pump")
    seen: list[bytes] = []
    for i in range(1000):
        pump.put(seen.append, b"%d" % i)
    pump.close()
    assert pump.thread is not None
    pump.thread.join(10)
    assert seen == [b"%d" % i for i in range(1000)]


def test_the_open_files_limit_is_raised_for_many_hosts() -> None:
    """1,000 hosts are 1,000 sockets: past a soft limit of 1,024 dtrain raises it (up to the
    hard limit), and never lowers it."""
    code = (
        "import resource\n"
        "from launcher.transport.ssh import ensure_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "ensure_open_files(100)\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 256\n"
        "ensure_open_files(3512)\n"
        "expected = 3512 if hard == resource.RLIM_INFINITY else min(hard, 3512)\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (expected, hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_invoke_loads_only_when_an_ssh_config_runs_match_exec() -> None:
    """paramiko imports invoke (and asyncio, yaml) for ``Match exec`` alone: dtrain's SSH
    transport loads without them, and a config's ``Match exec`` still works."""
    code = (
        "import sys\n"
        "import launcher.transport.ssh\n"
        "from launcher.transport.sshlib import paramiko\n"
        "assert not {'invoke.tasks', 'asyncio', 'yaml'} & set(sys.modules), sorted(sys.modules)\n"
        "config = paramiko.SSHConfig.from_text(\n"
        "    'Match exec \"test -n x\"\\n  HostName matched\\nHost *\\n  Port 2222\\n')\n"
        "assert config.lookup('node1')['hostname'] == 'matched', config.lookup('node1')\n"
        "assert 'invoke.tasks' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_requests_to_the_local_agent_are_answered_in_order_without_waiting() -> None:
    """Eight watchdogs asked for before any answer is read: each ticket gets its own pid."""
    from launcher.transport.localagent import LocalAgent

    agent = LocalAgent(sys.executable, dict(os.environ))
    import marshal

    body = marshal.dumps(
        {"argv": ["sh", "-c", "exit $0", "7"], "env": dict(os.environ), "cwd": None, "grace_s": 1}
    )
    tickets, ends = [], []
    for _ in range(8):
        pipes = [os.pipe() for _ in range(4)]
        tickets.append(agent.request(body, [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]))
        for fd in (pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]):
            os.close(fd)
        ends.append(pipes)
    pids = [ticket.pid() for ticket in tickets]
    assert len(set(pids)) == 8
    for pid, pipes in zip(pids, ends, strict=True):
        assert os.read(pipes[3][0], 16).strip() == b"7"  # each watchdog reports its own rank
        assert agent.wait_exit(pid, 10) == 7
        for fd in (pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]):
            os.close(fd)
    agent.close()


def test_a_rank_the_agent_cannot_fork_fails_with_its_pipes_closed() -> None:
    from launcher.base.errors import LauncherError
    from launcher.transport.local import LocalProcess
    from launcher.transport.localagent import Ticket

    ticket = Ticket()
    ticket.answer(b"! [Errno 11] Resource temporarily unavailable")
    pipes = [os.pipe() for _ in range(4)]
    ours = (pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0])
    spec = LaunchSpec(3, Host("localhost"), 0, argv=("true",), env={})
    process = LocalProcess(spec, None, ticket, ours)  # type: ignore[arg-type]
    with pytest.raises(LauncherError, match=r"cannot start rank 3 on localhost: \[Errno 11\]"):
        process.pid  # noqa: B018
    for fd in ours:
        with pytest.raises(OSError):
            os.fstat(fd)
    for fd in (pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]):
        os.close(fd)
