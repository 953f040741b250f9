"""The transports' part of ``--mpi``: mpirun, not dtrain's agents, starts the ranks, so an
``--mpi`` job's processes are found by their ``DTRAIN_JOB_ID`` on each host, here or
through the survey's host agents: signalled there when dtrain stops the job (mpirun,
the attempt's one process, lives on meanwhile: ``MpirunTransport``), their Python stacks
(``dtrain stacks``), and what mpirun left of them once it ended.  A host lost while
mpirun runs ends it.  And mpirun's output: its ``[1,R]<stream>:`` tagged lines split
back by rank (``MpiOutput``), with ``--output-dir``'s copies per rank (``RankCopies``),
its own report of the first failed rank kept."""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from launcher.base.log import LOG
from launcher.core.command import LaunchSpec
from launcher.core.mpi import parse_first_failure
from launcher.core.outcome import (
    PROGRESS,
    OutputSink,
    PassesTiming,
    RankState,
    Stream,
    keep_tail,
    new_tails,
)
from launcher.transport.base import AttachableProcess, Process, RankFeed, Transport
from launcher.transport.local import local_py_spy

if TYPE_CHECKING:
    from launcher.transport.agentlink import HostAgent
    from launcher.transport.ssh import SshConnection

HOST_POLL_S = 0.2  # while mpirun runs: how often the hosts' agents are looked at
MPIRUN_KILL_AFTER_S = 1.0  # SIGKILL: to the ranks first, to mpirun this much later (it hands
# on what they wrote before they died)
LEFTOVERS_S = 1.0  # after mpirun: how long killing what it left here may go on
MAX_OPEN_COPIES = 64  # --output-dir files kept open (append mode: reopening loses nothing)


def local_mpi_stacks(job_id: str) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on this machine (rank as text -> dump)."""
    from launcher.remote import agent

    found: dict[str, Any] = agent.dump_mpi_stacks(job_id, local_py_spy())
    return found


def kill_local_mpi_leftovers(job_id: str) -> list[int]:
    """SIGKILL what mpirun left of an ``--mpi`` job on this machine; the pids killed.  (On
    other hosts, their agents do it when the launcher closes them: ``agent.MPI_JOB``.)"""
    from launcher.remote import agent

    killed: list[int] = agent.kill_job_processes(job_id, LEFTOVERS_S)["killed"]
    return killed


def dump_remote_mpi_stacks(
    connection: SshConnection, job_id: str, timeout_s: float
) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on a remote host (mpirun started them,
    not an agent)."""
    from launcher.remote import agent
    from launcher.transport.remotecalls import agent_call  # paramiko: remote hosts only

    call = f"dump_mpi_stacks({job_id!r}, {agent.find_py_spy(None)!r})"
    return agent_call(connection, call, timeout_s)


class MpirunTransport:
    """The attempt's transport under ``--mpi``: mpirun started by the local transport, as
    an ``MpirunProcess``.  Each host's agent (the survey's) is told the job: it signals the
    job's ranks there when dtrain stops them, and kills what is left of them when the
    launcher closes it (the job's end) or falls silent.  While mpirun runs, a host lost
    (its agent silent for ``--host-timeout``, its connection cut) stops the ranks and then
    mpirun, whose daemons would wait for that host for as long as it is away; and once the
    ranks are being stopped, those mpirun starts after are signalled too (a Ctrl-C while
    it launches them)."""

    def __init__(
        self,
        local: Transport,
        job_id: str,
        agents: Mapping[str, HostAgent],
        grace_s: float,
        sessions: str | None = None,
    ) -> None:
        self.local = local
        self.job_id = job_id
        self.sessions = sessions  # the session folder of mpirun's daemons on each host
        self.agents = dict(agents)
        self.grace_s = grace_s
        self.closed = threading.Event()
        self.signalled: set[tuple[int, int]] = set()  # (pid, signal) of ranks here
        self.signalled_lock = threading.Lock()  # the loop's thread and the watcher's

    def start(self, spec: LaunchSpec) -> MpirunProcess:
        from launcher.remote import agent

        self.tell_agents(agent.MPI_JOB, f"{self.job_id}\n{self.sessions or ''}")
        process = MpirunProcess(self.local.start(spec), self.signal_ranks)
        threading.Thread(
            target=self.watch_hosts, args=(process,), name="dtrain-mpi-hosts", daemon=True
        ).start()
        return process

    def tell_agents(self, kind: int, text: str) -> None:
        """A frame to every host's agent still there (one that is not ends the ranks there
        by itself once it misses the launcher)."""
        from launcher.remote import agent

        for name, host_agent in self.agents.items():
            if host_agent.ended is None:
                try:
                    host_agent.send(agent.NO_RUN, kind, text.encode())
                except Exception as exc:  # OSError, paramiko's: the host is being lost
                    LOG.debug("cannot reach the agent on %s: %r", name, exc)

    def signal_ranks(self, signum: int) -> None:
        """Signal the job's ranks where mpirun started them: here, and through each host's
        agent elsewhere (SIGKILL there: every process of the ranks)."""
        from launcher.remote import agent

        with self.signalled_lock:
            agent.signal_mpi_ranks(self.job_id, signum, self.signalled)
        self.tell_agents(agent.SIGNAL_MPI_JOB, str(signum))

    def watch_hosts(self, process: MpirunProcess) -> None:
        """Until mpirun ends: once it is being stopped, the ranks started since are
        signalled too (each host signals a rank once per signal); a host lost stops it,
        SIGKILL after the grace."""
        kill_at = math.inf
        while not self.closed.wait(HOST_POLL_S) and not process.ended.is_set():
            if process.stopping is not None:
                self.signal_ranks(process.stopping)
            if time.monotonic() >= kill_at:
                kill_at = math.inf
                process.signal(signal.SIGKILL)
            lost = [(n, a.ended) for n, a in self.agents.items() if a.ended is not None]
            if lost and process.lost_cause is None:
                name, process.lost_cause = lost[0]
                LOG.debug("%s lost while mpirun ran (%s): stopping the job", name, lost[0][1])
                process.signal(signal.SIGTERM)
                kill_at = time.monotonic() + self.grace_s

    def close(self) -> None:
        self.closed.set()
        self.local.close()


class MpirunProcess:
    """mpirun as the supervisor's one process.  A signal goes to the ranks, where mpirun
    started them, not to mpirun, which lives on to hand on what they print while they stop
    (SIGTERM to mpirun itself would kill them at once, their last lines unheard); SIGKILL
    ends mpirun too, a moment after the ranks."""

    def __init__(self, process: Process, signal_ranks: Callable[[int], None]) -> None:
        self.process = process
        self.spec = process.spec
        self.signal_ranks = signal_ranks
        self.ended = threading.Event()  # mpirun exited
        self.stopping: int | None = None  # the signal its ranks were sent last
        self.lost_cause: str | None = None  # a host was lost under it

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def cause(self) -> str | None:
        return self.lost_cause or self.process.cause

    def read(self, stream: Stream, size: int) -> bytes:
        return self.process.read(stream, size)

    def wait(self) -> int:
        status = self.process.wait()
        self.ended.set()
        return status

    def attach(self, feed: RankFeed) -> None:
        assert isinstance(self.process, AttachableProcess), "the local transport's process"
        self.process.attach(ExitSeen(feed, self.ended))

    def signal(self, signum: int) -> None:
        if self.ended.is_set():
            return
        self.stopping = signum
        self.signal_ranks(signum)
        if signum == signal.SIGKILL:
            later = threading.Timer(MPIRUN_KILL_AFTER_S, self.kill_mpirun)
            later.daemon = True
            later.start()

    def kill_mpirun(self) -> None:
        if not self.ended.is_set():
            try:
                self.process.signal(signal.SIGKILL)
            except Exception as exc:  # the transport closed meanwhile: nothing to wait for
                LOG.debug("cannot SIGKILL mpirun: %r", exc)

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return self.process.dump_stacks(timeout)

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return self.process.take_stats(timeout)

    def gone(self, timeout: float) -> bool:
        return self.process.gone(timeout)


class ExitSeen:
    """mpirun's feed, passed on, with its exit noted (``MpirunProcess.ended``)."""

    def __init__(self, feed: RankFeed, ended: threading.Event) -> None:
        self.inner = feed
        self.ended = ended

    def feed(self, stream: Stream, data: bytes, on_room: Callable[[], None] | None = None) -> bool:
        return self.inner.feed(stream, data, on_room)

    def cut_off(self, stream: Stream, cause: str) -> None:
        self.inner.cut_off(stream, cause)

    def began(self) -> None:
        self.inner.began()

    def exited(self, status: int) -> None:
        self.ended.set()
        self.inner.exited(status)


class RankCopies:
    """``--output-dir`` under ``--mpi``: DIR/rank.N/stdout and stderr, each rank's lines as
    it wrote them (mpirun's tags gone), as without ``--mpi``; ``append``: a restart's."""

    def __init__(self, directory: Path, ranks: Iterable[int], append: bool) -> None:
        self.directory = directory
        self.files: dict[tuple[int, Stream], BinaryIO] = {}  # the most recently used last
        self.failed = False  # a full disk: the job goes on without its copies
        try:
            for rank in ranks:  # every rank's files, as without --mpi (empty if it says nothing)
                (directory / f"rank.{rank}").mkdir(parents=True, exist_ok=True)
                for stream in ("stdout", "stderr"):
                    open(directory / f"rank.{rank}" / stream, "ab" if append else "wb").close()
        except OSError:
            self.failed = True

    def write(self, rank: int, stream: Stream, lines: Sequence[bytes]) -> None:
        if self.failed:
            return
        try:
            file = self.files.pop((rank, stream), None)
            if file is None:
                file = open(self.directory / f"rank.{rank}" / stream, "ab")  # noqa: SIM115 (kept open)
                if len(self.files) >= MAX_OPEN_COPIES:
                    self.files.pop(next(iter(self.files))).close()
            self.files[(rank, stream)] = file
            # A progress update (a line a bare \r ended) keeps its \r, the others their \n.
            file.write(b"".join(ln if ln.endswith(PROGRESS) else ln + b"\n" for ln in lines))
            file.flush()
        except OSError:
            self.failed = True
            self.close()

    def close(self) -> None:
        """Close the files (a line that comes later opens its file again)."""
        files, self.files = self.files, {}
        for file in files.values():
            try:
                file.close()
            except OSError:
                pass


# The job's ranks are Open MPI's job 1; what MPI_Comm_spawn starts is job 2, 3, ...: their
# tagged lines are mpirun's to show (a spawned child's rank 0 is not the job's rank 0).
MPI_TAGGED = re.compile(rb"\[1,(\d+)\]<(stdout|stderr)>: ?")


class MpiOutput(PassesTiming):
    """An output sink in front of the view: splits mpirun's ``[1,R]<stream>:`` lines by rank.

    Lines without a tag are mpirun's own and are shown under the mpirun spec.
    """

    def __init__(
        self,
        view: OutputSink,
        specs: Mapping[int, LaunchSpec],
        launcher: LaunchSpec,
        copies: RankCopies | None = None,
    ) -> None:
        self.view = view
        self.specs = specs
        self.launcher = launcher
        self.copies = copies  # --output-dir: each rank's lines, untagged
        self.own_lines: list[str] = []
        self.tails: dict[int, dict[Stream, deque[bytes]]] = {}  # last lines per rank, stream
        # A view that holds lines (the collapsing view): its timing is passed on (outlets'
        # ``TimedSink``), else held lines would come out late, and the last ones never.
        self.timed: Any = view if hasattr(view, "show_at") else None

    def update(self, state: RankState) -> None:
        """mpirun's state stands for every rank it runs (mpirun tells no more)."""
        for rank, spec in self.specs.items():
            self.view.update(
                dataclasses.replace(state, rank=rank, host=spec.host.name, role=spec.role)
            )

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        self.show_at(spec, stream, lines, None)

    def show_at(
        self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], at: float | None
    ) -> None:
        """mpirun's lines, posted at ``at`` (None: now), split by rank for the view."""
        batch: list[bytes] = []
        current: tuple[int, Stream] | None = None
        for key, text in self.split(stream, lines):
            if key[0] < 0:
                self.own_lines.append(text.decode("utf-8", "replace"))
            if key[0] >= 0:
                keep_tail(self.tails.setdefault(key[0], new_tails())[key[1]], [text])
            if key != current and batch and current is not None:
                self.forward(current, batch, at)
                batch = []
            current = key
            batch.append(text)
        if batch and current is not None:
            self.forward(current, batch, at)

    def split(
        self, stream: Stream, lines: Sequence[bytes]
    ) -> Iterator[tuple[tuple[int, Stream], bytes]]:
        """Each line's pieces by rank: mpirun writes a rank's partial line (unittest's dots)
        and then another rank's tag on the same line; NUL bytes (from Open MPI's messages)
        never reach a view."""
        for raw in lines:
            line = raw.replace(b"\0", b"")
            tags = [m for m in MPI_TAGGED.finditer(line) if int(m[1]) in self.specs]
            if not tags or tags[0].start() > 0:
                head = line[: tags[0].start()] if tags else line
                yield (-1, stream), head
            for index, tag in enumerate(tags):
                end = tags[index + 1].start() if index + 1 < len(tags) else len(line)
                which: Stream = "stdout" if tag[2] == b"stdout" else "stderr"
                yield (int(tag[1]), which), line[tag.end() : end]

    def forward(self, key: tuple[int, Stream], lines: Sequence[bytes], at: float | None) -> None:
        rank, stream = key
        if rank >= 0 and self.copies is not None:
            self.copies.write(rank, stream, lines)
        spec = self.specs[rank] if rank >= 0 else self.launcher
        if at is not None and self.timed is not None:
            self.timed.show_at(spec, stream, lines, at)
        else:
            self.view.show(spec, stream, lines)

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, status) of the first failed rank, from mpirun's own report."""
        return parse_first_failure("\n".join(self.own_lines))
