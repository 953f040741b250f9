"""Ranks through Slurm: one dtrain agent per node, started by ``srun`` inside the allocation.

Where SSH into compute nodes is not allowed, ``srun`` is how processes start there
(and Slurm cleans them up).  Each node of the allocation gets one step,
``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap sh -c AGENT``, whose stdin
and stdout carry the same agent protocol as an SSH channel: ``SrunChannel`` gives
srun's pipes the few methods of a paramiko channel that ``HostAgent`` uses, so the
probe, the ranks, their output, exit codes, heartbeats and teardown work as over
SSH.  Closing the channel closes the agent's stdin (its lifeline: every rank is
ended) and then ends the step.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from launcher.base.errors import HostConnectionError, UsageError
from launcher.core.hostlist import expand_counts, expand_hostlist, quote
from launcher.core.hosts import MAX_COUNT, Host, check_host_name

STEP_END_S = 5.0  # after the lifeline closed, how long the step may take to end by itself
# Slurm's states of a job it has ended (or is ending): its ranks' signals came from Slurm.
ENDED_STATES = frozenset(
    {"CANCELLED", "COMPLETING", "COMPLETED", "TIMEOUT", "DEADLINE", "PREEMPTED", "NODE_FAIL",
     "FAILED", "OUT_OF_MEMORY", "BOOT_FAIL"}
)  # fmt: skip
ENDED_CACHE_S = 5.0  # one squeue for all the nodes of a failure's report
_ended: dict[str, tuple[float, bool]] = {}  # job id: (when asked, ended)


@dataclass(frozen=True)
class Allocation:
    """The Slurm job dtrain runs inside, as its environment describes it."""

    job_id: str
    hosts: tuple[Host, ...]  # nodes, with their task counts as slots

    @property
    def tasks(self) -> int:
        return sum(h.slots for h in self.hosts)

    def describe(self) -> str:
        nodes = ",".join(f"{h.name}:{h.slots}" for h in self.hosts)
        return f"inside Slurm job {self.job_id}: {self.tasks} task(s) on {nodes}"


def allocation_from(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation of ``SLURM_JOB_ID`` (None outside one): nodes from SLURM_JOB_NODELIST,
    tasks per node from SLURM_TASKS_PER_NODE (else SLURM_JOB_CPUS_PER_NODE, else 1).  A value
    Slurm would never set is a usage error naming the variable: a typo in an sbatch script,
    or a shell left with a half-copied environment."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    if not job_id.isascii() or not job_id.isdigit():
        raise UsageError(
            f"SLURM_JOB_ID {quote(job_id)}: not a Slurm job id (a number)",
            "run dtrain from salloc or an sbatch script, or unset SLURM_JOB_ID",
        )
    nodes_from = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = environ.get(nodes_from)
    if not nodelist:
        raise UsageError(
            f"inside Slurm job {job_id} but SLURM_JOB_NODELIST is not set",
            "run dtrain from salloc or an sbatch script, or give -H/--hostfile",
        )
    names = expand_hostlist(nodelist, nodes_from)
    for name in names:
        check_host_name(name, f"{nodes_from} {quote(nodelist)}")
    counts_from = (
        "SLURM_TASKS_PER_NODE" if environ.get("SLURM_TASKS_PER_NODE") else "SLURM_JOB_CPUS_PER_NODE"
    )
    counts_text = environ.get(counts_from)
    counts = expand_counts(counts_text, counts_from) if counts_text else []
    if counts and len(counts) != len(names):
        raise UsageError(
            f"{counts_from} {quote(counts_text or '')} gives {len(counts)} counts for "
            f"{len(names)} nodes ({quote(nodelist)})",
            "give -H/--hostfile with the slots",
        )
    for name, count in zip(names, counts, strict=False):
        if not 1 <= count <= MAX_COUNT:
            raise UsageError(
                f"{counts_from} {quote(counts_text or '')}: {count} tasks on node {name}",
                f"every node has at least 1 task (and dtrain takes at most {MAX_COUNT}): check "
                "the variable, or give -H/--hostfile with the slots",
            )
    slots = counts or [1] * len(names)
    return Allocation(job_id, tuple(Host(n, s) for n, s in zip(names, slots, strict=True)))


def node_addresses(names: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Each node's address as Slurm knows it (``scontrol show node``'s NodeAddr); the name
    where scontrol does not say."""
    found = {name: name for name in names}
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", ",".join(names)],
            capture_output=True,
            text=True,
            timeout=10,
            env=dict(environ),
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return found
    for line in out.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("NodeName") in found and fields.get("NodeAddr"):
            found[fields["NodeName"]] = fields["NodeAddr"]
    return found


class SrunChannel:
    """srun's stdin/stdout/stderr as an ``agentlink.AgentChannel``: the methods of a paramiko
    channel that ``HostAgent`` uses."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin and process.stdout and process.stderr
        self.process = process
        self.timeout: float | None = None
        self.closed = False
        self.stderr_ended = False  # srun's stderr is at its end: nothing more is ready there

    def sendall(self, data: bytes) -> None:
        if self.closed:
            raise OSError("the srun channel is closed")
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def recv(self, size: int) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        if self.timeout is not None:
            ready, _, _ = select.select([fd], [], [], self.timeout)
            if not ready:
                raise TimeoutError
        return os.read(fd, size)

    def recv_stderr_ready(self) -> bool:
        """Like paramiko's: data to read now (a pipe at its end selects as readable forever,
        which must not read as data: drain() loops while this is true)."""
        assert self.process.stderr is not None
        if self.stderr_ended:
            return False
        ready, _, _ = select.select([self.process.stderr.fileno()], [], [], 0)
        return bool(ready)

    def recv_stderr(self, size: int) -> bytes:
        assert self.process.stderr is not None
        data = os.read(self.process.stderr.fileno(), size)
        self.stderr_ended = not data
        return data

    def close(self) -> None:
        """Close the agent's lifeline, then let the step end (it ends its ranks), then end it."""
        if self.closed:
            return
        self.closed = True
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(STEP_END_S)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)  # srun: ask Slurm to end the step
            try:
                self.process.wait(STEP_END_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class SrunConnection:
    """A node of the allocation, reached through srun (what SshConnection is for SSH): an
    ``agentlink.HostLink``."""

    host: Host
    environ: Mapping[str, str]
    peer_address: str = ""
    local_address: str = ""
    channels: list[SrunChannel] = field(default_factory=list)

    @property
    def lost_cause(self) -> str:
        return f"the srun step on {self.host.name} ended (scancel, or the allocation's end)"

    def allocation_ended(self) -> bool:
        """Has Slurm ended (or begun to end) the job, by scancel or its time limit?  Asked
        when a rank dies by a signal dtrain did not send: a scancel signals every task of
        the step, the ranks and the agent at once, so which one dtrain hears of first is
        chance; the job's state is not."""
        job = self.environ.get("SLURM_JOB_ID", "")
        now = time.monotonic()
        asked = _ended.get(job)
        if asked is not None and now - asked[0] < ENDED_CACHE_S:
            return asked[1]
        ended = job_ended(job, self.environ)
        _ended[job] = (now, ended)
        return ended

    def agent_failed(self, last: str) -> HostConnectionError:
        """The error for an agent step that ended before its probe report (``last``: srun's
        or the agent's last line of stderr)."""
        job = self.environ.get("SLURM_JOB_ID", "?")
        return HostConnectionError(
            f"{self.host.name}: srun could not start dtrain's agent ({last})",
            f"check that Slurm job {job} still runs (squeue -j {job}) and that python3 is on "
            "the node, or use --transport ssh",
        )

    def open_channel(self, command: str, timeout_s: float) -> SrunChannel:
        srun = shutil.which("srun", path=self.environ.get("PATH"))
        if srun is None:
            raise HostConnectionError(
                f"{self.host.name}: srun not found on PATH",
                "load Slurm's module, or --transport ssh",
            )
        # --whole: the agent's step (and so every rank) may use all of the node's CPUs and
        # memory in the allocation; --unbuffered: srun passes output on at once (else it
        # waits for a newline; the agent's frames have none).
        argv = [
            srun, "--nodes=1", "--ntasks=1", f"--nodelist={self.host.name}", "--overlap",
            "--whole", "--unbuffered", "--quit-on-interrupt", "--job-name=dtrain-agent", "--quiet",
            "sh", "-c", command,
        ]  # fmt: skip
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(self.environ),
                start_new_session=True,  # a Ctrl-C is dtrain's to handle, not srun's
            )
        except OSError as exc:
            raise HostConnectionError(f"{self.host.name}: cannot run srun: {exc}") from None
        channel = SrunChannel(process)
        self.channels.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def job_ended(job: str, environ: Mapping[str, str]) -> bool:
    """squeue's word on a Slurm job: ended (or ending), or gone from its queue."""
    squeue = shutil.which("squeue", path=environ.get("PATH"))
    if squeue is None or not job:
        return False
    try:
        out = subprocess.run(
            [squeue, "-h", "-j", job, "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=5,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode != 0:
        return "invalid job id" in out.stderr.lower()  # purged: long ended
    state = out.stdout.strip()
    return state == "" or state in ENDED_STATES  # "": gone from the queue


def srun_connections(
    hosts: Sequence[Host], environ: Mapping[str, str]
) -> dict[str, SrunConnection]:
    addresses = node_addresses([h.name for h in hosts], environ)
    return {h.name: SrunConnection(h, environ, peer_address=addresses[h.name]) for h in hosts}
