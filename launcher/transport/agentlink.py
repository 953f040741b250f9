"""The launcher's end of the agent's wire protocol (``launcher/remote/agent.py``, sent as
text): over one channel per host, the agent probes the host, then starts each rank of the
host under a watchdog and multiplexes their output back, in frames.

``HostAgent`` frames, demultiplexes and beats the heartbeat of one host's channel;
``AgentProcess`` is a rank as its agent reports it (and what it is asked: stacks,
figures); ``SshTransport`` starts ranks through the hosts' agents.  When the channel ends,
or the launcher stops sending heartbeats, every watchdog ends its rank; signals travel as
frames (SSH itself cannot deliver them).  The channel is an SSH session
(``ssh.SshConnection``) or an srun step's pipes (``slurm.SrunConnection``): both are a
``HostLink``.
"""

from __future__ import annotations

import itertools
import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from launcher import remote
from launcher.base.errors import HostConnectionError
from launcher.base.log import LOG
from launcher.core.command import LaunchSpec, build_remote_command
from launcher.core.hosts import Host
from launcher.core.options import DEFAULT_HOST_TIMEOUT_S
from launcher.core.outcome import STREAMS, Stream
from launcher.remote import agent, watchdog
from launcher.transport.base import RankFeed
from launcher.transport.feeds import Pump
from launcher.transport.remotecalls import AGENT_SOURCE, PROBE_SOURCE, HostReport, report_from
from launcher.transport.sshlib import paramiko

HEARTBEAT_S = 5.0  # at most; both ends beat at least 4 times per host timeout
MAX_PREAMBLE_BYTES = 1 << 20  # what a login shell may print before the agent's frames
MAX_FRAME_BYTES = 16 << 20  # the agent's frames are 64 KiB of output or a report: a longer one
# says the stream is corrupt (read on, it would take memory without bound)
WATCHDOG_SOURCE = remote.source("watchdog")


class AgentChannel(Protocol):
    """What the agent link uses of a channel: a paramiko ``Channel``, or srun's pipes."""

    closed: bool

    def sendall(self, data: bytes, /) -> None: ...

    def settimeout(self, timeout: float | None, /) -> None: ...

    def recv(self, size: int, /) -> bytes: ...

    def recv_stderr_ready(self) -> bool: ...

    def recv_stderr(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


class HostLink(Protocol):
    """A way into a host that runs the agent: an SSH connection, or a Slurm node's srun."""

    @property
    def host(self) -> Host: ...

    def open_channel(self, command: str, timeout_s: float) -> AgentChannel: ...

    def agent_failed(self, last: str) -> HostConnectionError:
        """The error for an agent that ended before its probe report (``last``: the last
        line of its stderr)."""
        ...

    def close(self) -> None: ...


class HostAgent:
    """The launcher's end of one host's agent (``remote/agent.py``): one channel, every rank.

    Like mpirun's one daemon per host: the login shell and Python start once
    per host, not once per rank, and the probe shares the same channel.
    """

    def __init__(
        self,
        connection: HostLink,
        channel: AgentChannel,
        silence_s: float = DEFAULT_HOST_TIMEOUT_S,
    ) -> None:
        self.connection = connection
        self.channel = channel
        self.silence_s = silence_s  # an agent silent this long is lost (frozen, cut off)
        self.heard = time.monotonic()  # the last frame from the agent
        self.lost_cause: str | None = None
        self.ended: str | None = None  # why the channel ended, once it has (EOF, a lost host)
        self.lock = threading.Lock()
        self.processes: dict[int, AgentProcess] = {}  # by run id
        self.pump = Pump("dtrain-ssh-output")  # feeds attached ranks' output (one transport's)
        self.buffer = bytearray()  # received, not yet taken: from self.offset on
        self.offset = 0
        self.runs = 0

    @classmethod
    def open(
        cls,
        connection: HostLink,
        python: str,
        probe_args: Mapping[str, object],
        timeout_s: float,
        silence_s: float = DEFAULT_HOST_TIMEOUT_S,
    ) -> tuple[HostAgent, HostReport]:
        """Start the agent, wait for its probe report, then serve the ranks."""
        name = connection.host.name
        command = build_remote_command(python, ["-I", "-S", "-c", watchdog.BOOTSTRAP])
        config = {
            "probe": dict(probe_args),
            "probe_source": PROBE_SOURCE,
            "watchdog": WATCHDOG_SOURCE,
            # Beat often enough that a healthy agent is never silent for the host timeout,
            # and give the launcher up after the same silence.
            "heartbeat_s": min(agent.HEARTBEAT_S, silence_s / 4),
            "silence_s": silence_s,
            "py_spy": agent.find_py_spy(None),  # the same path there, if it exists
        }
        channel = None
        try:
            channel = connection.open_channel(command, timeout_s)
            channel.sendall(
                watchdog.frame(AGENT_SOURCE) + watchdog.frame(json.dumps(config).encode())
            )
            channel.settimeout(timeout_s)
            host = cls(connection, channel, silence_s)
            host.skip_to_start()
            _, kind, payload = host.next_frame()
        except TimeoutError:
            raise HostConnectionError(
                f"{name}: no answer from the host probe within {timeout_s:g}s",
                "check the host's load, or raise --ssh-timeout",
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if channel is None:
                raise HostConnectionError(f"{name}: cannot open an SSH channel: {exc}") from None
            last = (stderr_lines(channel) or ["the channel closed"])[-1]
            raise connection.agent_failed(last) from None
        if kind != agent.PROBED:
            raise HostConnectionError(f"{name}: unexpected answer from the host agent ({kind})")
        channel.settimeout(None)
        threading.Thread(target=host.demultiplex, daemon=True).start()
        threading.Thread(target=host.beat, daemon=True).start()
        return host, report_from(json.loads(payload))

    def skip_to_start(self) -> None:
        """Skip what the login shell printed before the agent started (rc files' banners)."""
        while True:
            start = self.buffer.find(agent.START_MARK)
            if start >= 0:
                del self.buffer[: start + len(agent.START_MARK)]
                return
            if len(self.buffer) > MAX_PREAMBLE_BYTES:
                shown = self.buffer[:200].decode("utf-8", "replace").strip()
                raise HostConnectionError(
                    f"{self.connection.host.name}: the login shell printed more than "
                    f"{MAX_PREAMBLE_BYTES} bytes before dtrain's agent started: {shown!r}",
                    "make the shell's rc files (~/.bashrc...) quiet for non-interactive shells",
                )
            chunk = self.channel.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buffer += chunk

    def beat(self) -> None:
        """Tell the agent the launcher lives, and give the host up when its agent falls
        silent (its heartbeats come every agent.HEARTBEAT_S), until the channel closes."""
        while not self.channel.closed:
            silent_s = time.monotonic() - self.heard
            if silent_s > self.silence_s:
                self.lost_cause = (
                    f"no word from the agent on {self.connection.host.name} for "
                    f"{self.silence_s:g} s: the host is frozen or cut off"
                )
                self.channel.close()  # the demultiplexer ends every rank of the host as lost
                return
            try:
                self.send(agent.NO_RUN, agent.HEARTBEAT, b"")
            except (OSError, paramiko.SSHException):
                return
            time.sleep(min(HEARTBEAT_S, self.silence_s / 4))

    def next_frame(self) -> tuple[int, int, bytes]:
        """The next frame from the agent; EOFError when the channel ends."""
        size = agent.HEADER.size
        while True:
            available = len(self.buffer) - self.offset
            if available >= size:
                rank, kind, length = agent.HEADER.unpack_from(self.buffer, self.offset)
                if length > MAX_FRAME_BYTES:
                    raise ValueError(
                        f"a frame of {length} bytes (at most {MAX_FRAME_BYTES} are sent): "
                        "the stream is corrupt"
                    )
                if available >= size + length:
                    start = self.offset + size
                    payload = bytes(self.buffer[start : start + length])
                    self.offset = start + length
                    self.heard = time.monotonic()
                    if self.offset * 2 >= len(self.buffer):  # amortized: each byte moves once
                        del self.buffer[: self.offset]
                        self.offset = 0
                    return rank, kind, payload
            chunk = self.channel.recv(1 << 18)
            if not chunk:
                raise EOFError
            self.buffer += chunk

    def demultiplex(self) -> None:
        """Route the agent's frames to the ranks' streams and exits, until the channel ends.

        Whatever ends it (a malformed frame too), every rank of the host then ends as lost,
        with the cause: none is left for the job to wait on."""
        name = self.connection.host.name
        try:
            while True:
                run, kind, payload = self.next_frame()
                process = self.processes.get(run)
                if process is not None:
                    process.receive(kind, payload)
        except (EOFError, OSError, paramiko.SSHException):
            pass
        except Exception as exc:  # a corrupt stream, an agent's bug: the host is given up
            LOG.debug("%s: malformed frame from the agent: %r", name, exc)
            self.lost_cause = self.lost_cause or f"malformed frame from the agent on {name}: {exc}"
            self.channel.close()  # the agent ends what runs there, as for a lost launcher
        cause = (
            self.lost_cause
            or getattr(self.connection, "lost_cause", None)  # srun: the step ended
            or f"the connection to {name} was lost"
        )
        self.ended = cause  # before the snapshot: a rank started later sees it (``start``)
        for process in list(self.processes.values()):  # a restart may add one meanwhile
            process.lost(cause)

    def send(self, rank: int, kind: int, payload: bytes) -> None:
        with self.lock:
            self.channel.sendall(agent.encode(rank, kind, payload))

    def start(self, spec: LaunchSpec, grace_s: float, path_prefix: str | None) -> AgentProcess:
        self.runs += 1
        process = AgentProcess(spec, self, self.runs)
        self.processes[self.runs] = process
        if self.ended is not None:  # the host was lost (the demultiplexer ended its ranks)
            process.lost(self.ended)
            return process
        remote_spec = {
            "argv": list(spec.argv),
            "env": dict(spec.env),
            "unset": list(spec.env_unset),
            "cwd": spec.cwd,
            "path_prefix": path_prefix,
            "grace_s": grace_s,
        }
        try:
            self.send(process.run, agent.START, json.dumps(remote_spec).encode())
        except (paramiko.SSHException, OSError) as exc:
            raise HostConnectionError(
                f"{spec.host.name}: cannot start rank {spec.rank}: {exc}"
            ) from None
        return process

    def close(self) -> None:
        self.channel.close()


def stderr_lines(channel: AgentChannel) -> list[str]:
    """The lines of what the channel's stderr holds now (the agent's last words)."""
    data = bytearray()
    while channel.recv_stderr_ready():
        data += channel.recv_stderr(65536)
    return data.decode("utf-8", "replace").strip().splitlines()


ANSWER_KINDS = frozenset(agent.ANSWERS.values())


class Question:
    """A question to an agent, until its answer comes."""

    def __init__(self) -> None:
        self.answered = threading.Event()
        self.answer: dict[str, Any] | None = None


class AgentProcess:
    """A remote rank, as its host's agent reports it."""

    def __init__(self, spec: LaunchSpec, host: HostAgent, run: int) -> None:
        self.spec = spec
        self.host = host
        self.run = run
        self.pid = 0
        self.queues: dict[Stream, queue.SimpleQueue[bytes]] = {
            "stdout": queue.SimpleQueue(),
            "stderr": queue.SimpleQueue(),
        }
        self.ended: set[Stream] = set()
        self.taken = 0  # output bytes read since credit was last returned to the agent
        self.withheld = 0  # output bytes fed while the outlets were full: credit not yet due
        self.taken_lock = threading.Lock()
        self.ends_seen: set[Stream] = set()  # streams whose end the agent sent (demultiplexer)
        self.cut_cause: str | None = None  # the host was lost after the rank's end, before
        # every stream's
        self.report = b""  # the watchdog's report of the program's status (STATUS frames)
        self.status: int | None = None
        self.settled = threading.Event()  # the status is known, or the rank is gone without one
        self.exited = threading.Event()
        self.started = threading.Event()  # the agent said the rank's pid (or the rank ended)
        self.code: int | None = None
        self.killed = False
        self.lost_cause: str | None = None  # the host was lost before the rank ended
        self.questions: dict[str, Question] = {}  # asked and not yet answered, by request id
        self.requests = itertools.count(1)  # request ids (next() holds the GIL: no lock)
        self.questions_lock = threading.Lock()
        self.fed: RankFeed | None = None  # attached: output and exits go there, not to queues
        self.told: set[str] = set()  # what the feed was told: "began", "exited"
        self.feed_lock = threading.Lock()

    def attach(self, feed: RankFeed) -> None:
        """Output goes to ``feed`` through the transport's pump (what came before first);
        the start and the status straight from the host's demultiplexer."""
        with self.feed_lock:
            for stream, chunks in self.queues.items():
                while True:
                    try:
                        data = chunks.get_nowait()
                    except queue.Empty:
                        break
                    self.host.pump.put(self.deliverer(stream, feed), data)
            self.fed = feed
            self.tell()

    def deliverer(self, stream: Stream, feed: RankFeed) -> Callable[[bytes], None]:
        """On the pump's thread, which serves every remote rank: it never waits.  While the
        rank's share of the outlets is full, what it is fed is not given back as credit
        (the agent stops reading the rank at the end of its window) until there is room."""

        def deliver(data: bytes) -> None:
            if stream in self.ended:
                return  # a second end (``finish`` ends every stream)
            if not data:
                self.ended.add(stream)
                if stream not in self.ends_seen and self.cut_cause is not None:
                    feed.cut_off(stream, self.cut_cause)  # the host was lost first
                else:
                    feed.feed(stream, data)
                return
            with self.taken_lock:
                self.withheld += len(data)
            if feed.feed(stream, data, self.release_credit):
                self.release_credit()

        return deliver

    def release_credit(self) -> None:
        """The outlets have room for this rank: the credit withheld goes back."""
        with self.taken_lock:
            size, self.withheld = self.withheld, 0
        if size:
            self.give_credit(size)

    def put(self, stream: Stream, data: bytes) -> None:
        """A chunk (b"": the end) of a stream: queued for ``read``, or fed on."""
        with self.feed_lock:
            if self.fed is None:
                self.queues[stream].put(data)
            else:
                self.host.pump.put(self.deliverer(stream, self.fed), data)

    def tell(self) -> None:
        """Tell the feed the start and the status, once each (as ``wait`` would return it)."""
        feed = self.fed
        if feed is None:
            return
        if "began" not in self.told and self.started.is_set():
            self.told.add("began")
            feed.began()
        if "exited" not in self.told and self.settled.is_set():
            status = self.status if self.status is not None else self.code
            if status is not None:
                self.told.add("exited")
                feed.exited(status)

    @property
    def cause(self) -> str | None:
        """Why the rank ended, where its status does not say: the host was lost, or (over
        srun) Slurm ended the job and its signal reached the rank first."""
        if self.lost_cause is not None or self.killed or self.status is None:
            return self.lost_cause
        if self.status < 0 and self.status != -signal.SIGINT:
            connection = self.host.connection
            ended = getattr(connection, "allocation_ended", None)
            if ended is not None and ended():
                try:
                    name = signal.Signals(-self.status).name
                except ValueError:
                    name = f"signal {-self.status}"
                step = getattr(connection, "lost_cause", "Slurm ended the job")
                self.lost_cause = f"killed by {name}: {step}"
        return self.lost_cause

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return self.ask(agent.DUMP_STACKS, timeout)

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return self.ask(agent.TAKE_STATS, timeout)

    def ask(self, kind: int, timeout: float) -> dict[str, Any]:
        """One question about this rank to its host's agent, and its answer: each question
        has a request id, which the answer echoes (two askers at once, the hang's dump and
        ``dtrain stacks``, each get their own; an answer that comes too late, none)."""
        request, question = str(next(self.requests)), Question()
        with self.questions_lock:
            self.questions[request] = question
        try:
            try:
                self.host.send(self.run, kind, request.encode())
            except (OSError, paramiko.SSHException) as exc:
                return {"error": f"cannot reach {self.spec.host.name}: {exc}"}
            if not question.answered.wait(timeout) or question.answer is None:
                return {"error": f"no answer from {self.spec.host.name} within {timeout:g} s"}
            return question.answer
        finally:
            with self.questions_lock:
                self.questions.pop(request, None)

    def take_answer(self, payload: bytes) -> None:
        """An answer from the agent, to the question of its request id (if still asked)."""
        reply = json.loads(payload)
        with self.questions_lock:
            question = self.questions.pop(str(reply["request"]), None)
        if question is not None:  # (else its asker gave up waiting: a late answer is dropped)
            question.answer = dict(reply["answer"])
            question.answered.set()

    def receive(self, kind: int, payload: bytes) -> None:
        if kind in (agent.STDOUT, agent.STDERR):
            self.put("stdout" if kind == agent.STDOUT else "stderr", payload)
        elif kind in (agent.STDOUT_END, agent.STDERR_END):
            stream: Stream = "stdout" if kind == agent.STDOUT_END else "stderr"
            self.ends_seen.add(stream)
            self.put(stream, b"")
        elif kind == agent.STATUS:
            self.report += payload
            if self.report.endswith(b"\n") and self.report.strip().lstrip(b"-").isdigit():
                self.status = int(self.report)
                self.settled.set()
                with self.feed_lock:
                    self.tell()
        elif kind == agent.STARTED:
            self.pid = int(payload)
            self.started.set()
            with self.feed_lock:
                self.tell()
        elif kind == agent.FAILED:
            self.put("stderr", b"dtrain: cannot start the rank: " + payload + b"\n")
            self.finish(127)
        elif kind == agent.EXITED:
            self.finish(int(payload))
        elif kind in ANSWER_KINDS:
            self.take_answer(payload)

    def finish(self, code: int) -> None:
        for stream in STREAMS:
            if stream not in self.ended:
                self.put(stream, b"")  # harmless if the stream had ended already
        self.code = code
        self.exited.set()
        self.settled.set()
        self.started.set()
        with self.feed_lock:
            self.tell()

    def lost(self, cause: str) -> None:
        """The connection to the host ended (or was given up) before the rank did."""
        if not self.exited.is_set():
            if not self.killed:
                self.lost_cause = cause
            if self.status is not None and not self.ends_seen.issuperset(STREAMS):
                # It had ended by itself: the tail of its output, still in flight, is gone
                # (a rank that dies with its host fails as lost: that says it all).
                self.cut_cause = cause
            self.finish(-signal.SIGKILL if self.killed else 255)

    def read(self, stream: Stream, size: int) -> bytes:
        if stream in self.ended:
            return b""
        data = self.queues[stream].get()
        if not data:
            self.ended.add(stream)
        else:
            self.give_credit(len(data))
        return data

    def give_credit(self, size: int) -> None:
        """Let the agent send what was taken again (a quarter window at a time)."""
        with self.taken_lock:
            self.taken += size
            if self.taken < agent.WINDOW_BYTES // 4:
                return
            credit, self.taken = self.taken, 0
        try:
            self.host.send(self.run, agent.CREDIT, str(credit).encode())
        except (OSError, paramiko.SSHException):
            pass

    def wait(self) -> int:
        # The status comes the moment the program exits (before its leftovers are ended):
        # it, not the agent's later EXITED, decides which rank failed first.
        self.settled.wait()
        if self.status is not None:
            return self.status
        self.exited.wait()
        assert self.code is not None
        return self.code

    def gone(self, timeout: float) -> bool:
        # EXITED comes once the watchdog exited, after ending what the program left.
        return self.exited.wait(timeout)

    def signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.killed = True
        if self.exited.is_set():
            return
        try:
            self.host.send(self.run, agent.SIGNAL, str(signum).encode())
        except (OSError, paramiko.SSHException):
            pass


class SshTransport:
    """Starts ranks through each host's agent; closing it drops the connections (and the ranks)."""

    def __init__(
        self,
        agents: Mapping[str, HostAgent],
        grace_s: float,
        path_prefix: str | None,
    ) -> None:
        self.agents = dict(agents)
        self.grace_s = grace_s
        self.path_prefix = path_prefix
        self.pump = Pump("dtrain-ssh-output")  # one thread feeds every host's ranks' output
        for host in self.agents.values():
            host.pump = self.pump

    def start(self, spec: LaunchSpec) -> AgentProcess:
        return self.agents[spec.host.name].start(spec, self.grace_s, self.path_prefix)

    def close(self) -> None:
        for host in self.agents.values():
            host.close()
            host.connection.close()
        self.pump.close()
