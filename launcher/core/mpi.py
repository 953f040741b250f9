"""The pure part of ``--mpi``: how dtrain's plan is told to Open MPI's ``mpirun``.

Values in, values out: the hostfile's text, the mapping that puts the ranks where
dtrain placed them, mpirun's command line (every variable forwarded by name, never by
value), the variables each rank reads back through the rank shim, the MCA parameters,
and mpirun's own report of the first failed rank read back.  Finding mpirun and
writing its hostfile are the job layer's (``run/mpi.py``).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig
from launcher.core.hosts import Host
from launcher.core.plan import Plan
from launcher.core.specs import NIC_VARIABLES, Site

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


@dataclass(frozen=True)
class MpiMapping:
    """How mpirun is told to place the ranks where dtrain placed them."""

    slots: dict[str, int]  # the hostfile's slots per host
    map_by: str  # mpirun's --map-by
    oversubscribe: bool  # more ranks than slots somewhere: Open MPI must know (it yields then)
    rank_by: str | None = None  # mpirun's --rank-by, where its default order is not dtrain's


def fill(counts_of: Sequence[int], np: int) -> list[int]:
    """Open MPI's --map-by slot without oversubscription: each host's slots in order."""
    placed, left = [], np
    for slots in counts_of:
        placed.append(min(slots, left))
        left -= placed[-1]
    return placed


def mpi_mapping(placed: Mapping[str, int], real: Mapping[str, int], map_by: str) -> MpiMapping:
    """Tell Open MPI the hosts' real slots (so it knows when it oversubscribes and does not
    busy-poll) and a mapping that puts the ranks where dtrain's plan has them.

    Slots left over are MPI_Comm_spawn's: its children inherit the mapping (``:INHERIT``,
    ``build_mpirun_argv``), so it is by slot or by node wherever that places the ranks, and
    ppr (which would cap the children at K a host too) only where nothing else does."""
    names = list(placed)
    counts = [placed[n] for n in names]
    slots = [real.get(n, placed[n]) for n in names]
    over = any(c > s for c, s in zip(counts, slots, strict=True))
    np = sum(counts)
    if len(names) == 1:
        return MpiMapping({names[0]: slots[0]}, "slot", over)
    if not over and map_by == "slot" and fill(slots, np) == counts:
        return MpiMapping(dict(zip(names, slots, strict=True)), "slot", False)
    if not over and dealt(slots, np) == counts:  # K on every host, say: dealt, then numbered
        rank_by = "slot" if map_by == "slot" else None  # ...as dtrain numbers them
        return MpiMapping(dict(zip(names, slots, strict=True)), "node", False, rank_by)
    if len(set(counts)) == 1:  # K on every host, more than some host's slots
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


def placed_counts(plan: Plan) -> dict[str, int]:
    """How many ranks dtrain's plan puts on each host, in the plan's order of hosts."""
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.host.name] = counts.get(rank.host.name, 0) + 1
    return counts


def real_slots(plan: Plan, site: Site, config: JobConfig, cpu_count: int | None) -> dict[str, int]:
    """Each host's real slots: the hostfile's or -H's, else (localhost by default) its cores
    (``cpu_count``: this machine's, where the survey counted none)."""
    if config.placement.hosts_given:
        return {h.name: h.slots for h in plan.hosts}
    return {h.name: len(site.cpus.get(h.name, ())) or cpu_count or h.slots for h in plan.hosts}


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
    rank_by: str | None = None,
    prte: Mapping[str, str] | None = None,
) -> list[str]:
    """Open MPI's mpirun command line for a dtrain job.

    Every variable dtrain sets is forwarded by name (``-x NAME``): its value is in
    mpirun's environment, never on a command line (where ``ps`` would show it).
    ``--output tag`` gives ``[1,RANK]<stdout>:`` prefixes that dtrain turns back
    into its own tags.  ``:INHERIT``: what MPI_Comm_spawn starts is placed and bound as
    the job is (Open MPI's own default for them would bind each to a core: more children
    than free cores fail, free slots or not).
    """
    command = [mpirun, "-np", str(np), "--hostfile", hostfile, "--map-by", f"{map_by}:INHERIT"]
    if rank_by:
        command += ["--rank-by", rank_by]
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
    for name, value in (prte or {}).items():
        command += ["--prtemca", name, value]
    for name in env_names:
        command += ["-x", name]
    return [*command, *extra, "sh", "-c", RANK_SHIM, "dtrain-rank", *argv]


# Every MPI rank gets the torch contract (RANK, LOCAL_RANK, ...) from Open MPI's own values, and
# what dtrain's plan gave it (node rank, host, GPUs, NICs) from DTRAIN_RANK_<rank>, whose
# NAME='value' words (quoted by ``rank_variables``) the shell reads back with eval, values
# whole (spaces, quotes, $); every DTRAIN_RANK_<r> is then unset (mpirun forwards them all to
# every rank: a rank sees only its own values).  The folders that DTRAIN_CHECKPOINT_DIR and
# DTRAIN_METRICS_FILE name are made (0700) where missing, as the watchdog makes them for the
# ranks it starts (one the user named that cannot be made ends the rank, 126, naming it; one
# dtrain chose is warned about); then the shell
# execs the program (same pid for mpirun).  One sh per rank, its builtins only (and a mkdir
# where a folder is missing): no interpreter.
RANK_SHIM = (
    'export RANK="$OMPI_COMM_WORLD_RANK" WORLD_SIZE="$OMPI_COMM_WORLD_SIZE" '
    'LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE" '
    'ROLE_RANK="$OMPI_COMM_WORLD_RANK"; '
    'eval "dtrain_own=\\${DTRAIN_RANK_$OMPI_COMM_WORLD_RANK-}"; dtrain_r=0; '
    'while [ "$dtrain_r" -lt "$OMPI_COMM_WORLD_SIZE" ]; do '
    'unset "DTRAIN_RANK_$dtrain_r"; dtrain_r=$((dtrain_r + 1)); done; '
    '[ -z "$dtrain_own" ] || eval "export $dtrain_own"; unset dtrain_own dtrain_r; '
    'dtrain_folder() { [ -z "$2" ] || [ -d "$2" ] && return; '
    'if [ -e "$2" ]; then dtrain_why="a file is in the way"; '
    'elif dtrain_why=$( (umask 077 && mkdir -p -- "$2") 2>&1); then return; '
    'else dtrain_why="${dtrain_why##*: }"; fi; '
    'if [ -n "$3" ]; then echo "dtrain: warning: cannot create $1 $2: $dtrain_why" >&2; '
    'return; fi; echo "dtrain: cannot create $1 $2: $dtrain_why" >&2; exit 126; }; '
    'case "${DTRAIN_CHECKPOINT_DIR-}" in */"${DTRAIN_JOB_ID-}"/checkpoints) dtrain_own=1;; '
    "*) dtrain_own=;; esac; "
    'dtrain_folder DTRAIN_CHECKPOINT_DIR "${DTRAIN_CHECKPOINT_DIR-}" "$dtrain_own"; '
    'case "${DTRAIN_METRICS_FILE-}" in */?*) '
    'dtrain_folder DTRAIN_METRICS_FILE "${DTRAIN_METRICS_FILE%/*}" 1;; esac; '
    "unset dtrain_own; "
    'unset -f dtrain_folder; exec "$@"'
)
RANK_OWN = (
    "NODE_RANK",
    "GROUP_RANK",
    "DTRAIN_HOST",
    "CUDA_VISIBLE_DEVICES",
    "DTRAIN_CPUS",
    *NIC_VARIABLES,
)


def rank_variables(specs: Sequence[LaunchSpec]) -> dict[str, str]:
    """DTRAIN_RANK_<r>: rank r's own variables from dtrain's plan, as NAME='VALUE' words for
    the shim's eval (each value quoted for sh: it arrives whole, whatever it holds)."""
    found = {}
    for spec in specs:
        words = [f"{name}={shlex.quote(spec.env[name])}" for name in RANK_OWN if name in spec.env]
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


SESSION_PARAMETERS = ("prte_tmpdir_base", "prte_local_tmpdir_base", "prte_remote_tmpdir_base")


def session_parameters(
    local: str, remote: str | None, environ: Mapping[str, str], mpirun_args: str
) -> dict[str, str]:
    """Where mpirun and its daemons keep their session folders (``ompi.<pid>`` here,
    ``prted.<pid>`` on each host): folders of this job's own, which dtrain removes at its end,
    rather than ``/tmp``, where a mpirun or daemon that was killed leaves its folder for a
    later one with the same pid to fail on ("The PMIx server's listener thread failed to
    start").  Left to the user where they set any of these themselves."""
    given = any(f"PRTE_MCA_{name}" in environ for name in SESSION_PARAMETERS)
    if given or "tmpdir_base" in mpirun_args:
        return {}
    found = {"prte_local_tmpdir_base": local}
    if remote is not None:
        found["prte_remote_tmpdir_base"] = remote
    return found


# Open MPI 5.0's daemons (prted) fork their ranks on a pool of up to 16 threads, and a rank
# that ends before its thread has stored its pid is never counted as ended (its exit status was
# taken by a waitpid that matched no rank): mpirun then waits forever, every line of the job
# printed.  A rank that fails at once (a bad argument, a missing file) hit it about once in 40
# runs on a loaded machine.  With no pool, a daemon forks on the thread that reaps, and cannot.
# (PRRTE's own fix, openpmix/prrte#2713, came after Open MPI 5.0.x.)
LAUNCH_PARAMETERS = {"odls_base_max_threads": "0"}


def launch_parameters(environ: Mapping[str, str], mpirun_args: str) -> dict[str, str]:
    """``LAUNCH_PARAMETERS``, each unless the user set it (``PRTE_MCA_<name>`` or in
    ``--mpirun-args``)."""
    return {
        name: value
        for name, value in LAUNCH_PARAMETERS.items()
        if f"PRTE_MCA_{name}" not in environ and name not in mpirun_args
    }


def rank_specs(plan: Plan, template: LaunchSpec) -> dict[int, LaunchSpec]:
    """Specs that stand for each MPI rank in the view (tags show rank and host)."""
    return {
        r.rank: dataclasses.replace(
            template, rank=r.rank, host=r.host, local_rank=r.local_rank, node_rank=r.node_rank
        )
        for r in plan.ranks
    }


def parse_first_failure(text: str) -> tuple[int, int] | None:
    """(rank, status) of the first failed rank in mpirun's own report."""
    exit_match = MPI_FIRST_EXIT.search(text)
    if exit_match:
        return int(exit_match[1]), int(exit_match[2])
    signal_match = MPI_FIRST_SIGNAL.search(text)
    if signal_match:
        return int(signal_match[1]), -int(signal_match[3])
    return None
