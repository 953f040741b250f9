"""A job from its config to its result (the job layer): plan, survey, specs, run.

``run_job`` is what ``dtrain run`` and ``dtrain ps`` call.  One attempt is:
plan the ranks, survey the hosts (connect, probe ports, GPUs, addresses),
bind GPUs, build every rank's spec (pure, ``specs.build_job_specs``), then
either describe it (``--dry-run``) or run it under the supervisor with the
job directory recording everything.  The survey, the transports and the
terminal (``Frontend``) come in as arguments, so the whole path runs in
tests on a fake transport without a process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from launcher import remote
from launcher.base.clock import Clock
from launcher.base.errors import HostConnectionError, LauncherError, PlanError
from launcher.base.jobid import new_job_id
from launcher.base.log import LOG
from launcher.core.command import LaunchSpec, describe_specs
from launcher.core.config import JobConfig, rank_set, validate_config
from launcher.core.env import resolve_env_args
from launcher.core.hosts import Host, parse_host_list
from launcher.core.outcome import JobResult, OutputSink
from launcher.core.plan import (
    Plan,
    bind_cpus,
    bind_gpus,
    bind_ps_gpus,
    elastic_np,
    per_node_counts,
    plan_ps,
    plan_ranks,
    select_hosts,
)
from launcher.core.policy import (
    AttemptEnd,
    RestartAfter,
    decide_restart,
    describe_status,
    discovery_change,
    hosts_left_out,
)
from launcher.core.specs import ServerProgram, Site, build_job_specs
from launcher.loop.supervisor import Supervisor, TimeLimits, caught_signals
from launcher.run.survey import (
    Survey,
    allocation_hosts,
    check_local_program,
    discover_hosts,
    hostfile_shorthand,
    read_hosts,
    read_text,
    shorthand_notice,
    slurm_allocation,
    survey_hosts,
)
from launcher.streams.control import SOCKET_NAME, ControlServer
from launcher.streams.jobdir import (
    STOP_MARK,
    JobDir,
    JobRecorder,
    end_record,
    jobs_root,
    open_private,
    prepare_output_dir,
    record_attempt,
    write_json,
)
from launcher.streams.outlets import Fanout, Outlet
from launcher.transport.base import RoutedTransport, Transport
from launcher.transport.local import (
    LocalTransport,
    detect_local_gpus,
    find_program,
    is_local_address,
)

if TYPE_CHECKING:  # loaded when needed: a plain local job needs neither mpirun nor stacks
    from launcher.core.stacks import StackGroup

VIEW_PATIENCE_S = 2.0  # after Ctrl-C/SIGTERM, how long the view may take to show what is left
MPI4PY_WARNING = (
    "dtrain: warning: this looks like an mpi4py program; without --mpi every rank is an MPI "
    "singleton of size 1 (add --mpi to run it through mpirun)"
)


class Frontend(Protocol):
    """The terminal, as the edge gives it to the job (the job layer never prints)."""

    def open_view(
        self, job_id: str, plan: Plan, remote: bool = False, attempt: int = 0
    ) -> tuple[OutputSink, AbstractContextManager[Any]]:
        """The sink for this job's output and states, and the context that shows it;
        ``remote``: some rank runs on another machine (tags name the host)."""
        ...

    def notice(self, text: str) -> None:
        """A line for the user (a warning, say)."""
        ...


SurveyHosts = Callable[[Plan, JobConfig, Mapping[str, str], str], Survey]
# The survey whose agents to use (None: every rank on this machine), the config, the environment.
OpenTransport = Callable[[Survey | None, JobConfig, Mapping[str, str]], Transport]


@dataclass(frozen=True)
class DryRun:
    """``--dry-run``: what would run, and nothing started."""

    entries: list[dict[str, object]]  # one per rank (describe_specs)
    mpirun: list[str] | None = None  # --mpi: mpirun's command line...
    hostfile: str | None = None  # ...its hostfile...
    mpirun_env: Mapping[str, str] = field(default_factory=dict)  # ...and what it forwards


@dataclass(frozen=True)
class Finished:
    result: JobResult
    master_port: int | None = None  # the attempt's rendezvous port (a restart takes another)
    failed_hosts: frozenset[str] = frozenset()  # remote hosts to leave out of a restart

    @property
    def lost_hosts(self) -> frozenset[str]:
        """The failed hosts that were lost (cut off, agent silent): ranks may still run there."""
        return self.result.lost_hosts & self.failed_hosts


JobOutcome = DryRun | Finished


def open_transport(
    survey: Survey | None, config: JobConfig, environ: Mapping[str, str]
) -> Transport:
    """Local ranks under local watchdogs; remote ones through the agents the survey started."""
    local = LocalTransport(environ, grace_s=config.grace_s)
    if survey is None or not survey.agents:
        return local
    from launcher.transport.ssh import SshTransport

    remote_hosts = survey.site.remote_hosts
    ssh = SshTransport(survey.hand_over(), grace_s=config.grace_s, path_prefix=environ.get("PATH"))
    return RoutedTransport(local, ssh, remote_hosts=remote_hosts)


def run_job(
    config: JobConfig,
    environ: Mapping[str, str],
    frontend: Frontend,
    *,
    survey: SurveyHosts = survey_hosts,
    transports: OpenTransport = open_transport,
    clock: Clock | None = None,
) -> JobOutcome:
    """Validate, resolve what the whole job shares, then run its attempt."""
    config = validate_config(with_hostfile_shorthand(config, frontend))
    allocation = allocation_hosts(config, environ)
    if allocation is not None:
        how = "through srun" if slurm_allocation(config, environ) else "over ssh"
        frontend.notice(f"dtrain: {allocation.describe()}; ranks start {how}")
    note = interpreter_note(config.command, environ)
    if note:
        frontend.notice(note)
    files = [(path, read_text(path, "--env-file")) for path in config.env.env_files]
    extra = resolve_env_args(config.env.exports, files, environ)
    job_id = config.job_id or new_job_id()
    attempt = Attempt(
        config=config,
        environ=environ,
        frontend=frontend,
        job_id=job_id,
        extra=extra,
        workdir=config.env.workdir or os.getcwd(),
        output_dir=None if config.dry_run else prepare_output_dir(config.view.output_dir),
        survey=survey,
        transports=transports,
        clock=clock,
        checkpoint_dir=config.checkpoint_dir
        or str(jobs_root(config.job_dir, environ) / job_id / "checkpoints"),
    )
    return run_attempts(attempt)


def run_attempts(attempt: Attempt) -> JobOutcome:
    """The job's attempts: after a failure, the whole job again (``--max-restarts``) on new
    ports, once nothing of the failed attempt runs anywhere (the supervisor saw to that).
    From the end of the first attempt on, a signal to dtrain (Ctrl-C, SIGTERM, dtrain stop)
    at any moment, between attempts too, means no more attempts."""
    outcome = attempt.run()
    if not isinstance(outcome, Finished) or not attempt.config.several_attempts:
        return outcome
    signalled = threading.Event()
    with caught_signals(lambda signum: signalled.set(), enabled=True):
        return later_attempts(attempt, outcome, signalled)


def later_attempts(attempt: Attempt, outcome: Finished, signalled: threading.Event) -> JobOutcome:
    config, ports = attempt.config, set[int]()
    failed: dict[str, float] = {}  # host -> when it failed
    began = time.monotonic() - outcome.result.elapsed_s  # when the first attempt started
    charged = 0  # restarts after failures (host changes are not counted)
    while True:
        result = outcome.result
        ports.update([outcome.master_port] if outcome.master_port else [])
        failed.update({host: time.monotonic() for host in outcome.failed_hosts})
        limit = config.time_limit_s
        end = attempt_end(result, limit is not None and time.monotonic() - began >= limit)
        after = decide_restart(end, charged, config.max_restarts, config.restart_delay_s)
        if after is None:
            return outcome
        if signalled.is_set():  # (during the attempt's own end: the view, the record)
            attempt.record_end(outcome)
            return outcome
        cooldown = config.placement.blacklist_cooldown_s
        if outcome.lost_hosts:
            # A cut-off host's agent ends its ranks by itself after the host timeout and the
            # grace: the next attempt waits that long, so no rank of this one runs any more.
            # (A host whose ranks all died by a signal told us so: nothing to wait for.)
            after = replace(
                after, delay_s=max(after.delay_s, config.ssh.host_timeout_s + config.grace_s)
            )
        attempt.frontend.notice(
            f"dtrain: {result.rescale}: starting again on its hosts (not counted as a restart)"
            if result.rescale
            else restart_notice(result, after, config.max_restarts, attempt.number)
        )
        charged, delay = after.attempt, after.delay_s
        # Announced: the failed hosts still left out when the next attempt starts (a cooldown
        # shorter than the wait lets them back).
        left_out = hosts_left_out(failed, time.monotonic() + delay, cooldown) & outcome.failed_hosts
        if left_out:
            back = f"; back after {cooldown:g} s" if cooldown is not None else ""
            hosts = ", ".join(sorted(left_out))
            attempt.frontend.notice(f"dtrain: leaving out {hosts} (failed{back})")
        if signalled.wait(delay):
            attempt.frontend.notice("dtrain: signalled while waiting: no restart")
            attempt.record_end(outcome)
            return outcome
        attempt = replace(
            attempt,
            number=attempt.number + 1,
            charged=charged,
            avoid_ports=frozenset(ports),
            excluded=hosts_left_out(failed, time.monotonic(), cooldown),
            world_size=None if config.placement.elastic else result.world_size,
            cancelled=signalled,
            spent_s=time.monotonic() - began,
        )
        try:
            next_outcome = run_without_unreachable(attempt, failed)
        except LauncherError as exc:
            # The job ends as its last attempt did: that is the failure to report.
            attempt.frontend.notice(f"dtrain: cannot restart: {exc}")
            attempt.record_end(outcome)
            return outcome
        if not isinstance(next_outcome, Finished):
            return next_outcome
        outcome = next_outcome


StacksSource = Callable[[float], dict[int, tuple[str, dict[str, Any]]]]


def mpi_stacks(job_id: str, plan: Plan, surveyed: Survey) -> StacksSource:
    """``dtrain stacks`` for an --mpi job: on each host of the plan, its processes of the job's
    ranks (mpirun started them, not dtrain: found by DTRAIN_JOB_ID and OMPI_COMM_WORLD_RANK),
    asked here directly and over the survey's SSH connections elsewhere."""
    from launcher.transport.local import local_mpi_stacks

    hosts = list(dict.fromkeys(rank.host.name for rank in plan.ranks))

    def take(timeout_s: float) -> dict[int, tuple[str, dict[str, Any]]]:
        found: dict[int, tuple[str, dict[str, Any]]] = {}
        errors: dict[str, str] = {}

        def on(host: str) -> None:
            if surveyed.site.local.get(host, True) or host not in surveyed.connections:
                dumps = local_mpi_stacks(job_id)
            else:
                from launcher.transport.ssh import dump_mpi_stacks

                dumps = dump_mpi_stacks(surveyed.connections[host], job_id, timeout_s)
            if isinstance(dumps.get("error"), str):
                errors[host] = dumps["error"]
                return
            found.update({int(rank): (host, dump) for rank, dump in dumps.items()})

        threads = [threading.Thread(target=on, args=(host,), daemon=True) for host in hosts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 1)
        for rank in plan.ranks:
            why = errors.get(rank.host.name, "not running (not started yet, or ended)")
            found.setdefault(rank.rank, (rank.host.name, {"error": why}))
        return found

    return take


def run_without_unreachable(attempt: Attempt, failed: dict[str, float]) -> JobOutcome:
    """A restart: hosts that cannot be reached now are failed hosts too (left out, with the
    cooldown), and the attempt is planned again without them, while any are left."""
    cooldown = attempt.config.placement.blacklist_cooldown_s
    while True:
        try:
            return attempt.run()
        except HostConnectionError as exc:
            signalled = attempt.cancelled is not None and attempt.cancelled.is_set()
            if signalled or not exc.hosts or exc.hosts <= attempt.excluded:
                raise
            attempt.frontend.notice(
                f"dtrain: leaving out {', '.join(sorted(exc.hosts))} (unreachable: {exc.message})"
            )
            failed.update({host: time.monotonic() for host in exc.hosts})
            attempt = replace(attempt, excluded=hosts_left_out(failed, time.monotonic(), cooldown))


def kill_mpi_leftovers(job_id: str, plan: Plan, surveyed: Survey) -> dict[str, list[int]]:
    """After mpirun: SIGKILL every process of the job still on a host of the plan (found by
    its DTRAIN_JOB_ID), here and over the survey's SSH connections; host -> pids killed."""
    from launcher.transport.local import kill_local_mpi_leftovers

    killed: dict[str, list[int]] = {}

    def on(host: str) -> None:
        if surveyed.site.local.get(host, True) or host not in surveyed.connections:
            pids = kill_local_mpi_leftovers(job_id)
        else:
            from launcher.transport.ssh import kill_mpi_leftovers as remote_kill

            answer = remote_kill(surveyed.connections[host], job_id, LEFTOVERS_TIMEOUT_S)
            pids = answer.get("killed") or []
            if "error" in answer:
                LOG.warning("cannot look for leftovers on %s: %s", host, answer["error"])
        if pids:
            killed[host] = pids

    threads = [
        threading.Thread(target=on, args=(host,), daemon=True)
        for host in dict.fromkeys(rank.host.name for rank in plan.ranks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LEFTOVERS_TIMEOUT_S + 1)
    return killed


LEFTOVERS_TIMEOUT_S = 15.0
DISCOVERY_POLL_S = 3.0  # how often --host-discovery-script runs while an attempt runs
STACKS_TIMEOUT_S = 25.0
STATS_TIMEOUT_S = 5.0


def open_control(job: JobDir, supervisor: Supervisor) -> ControlServer | None:
    """Let ``dtrain stacks`` ask this job (a job directory where no socket fits goes without)."""

    def answer(request: Mapping[str, Any]) -> Mapping[str, Any]:
        if request.get("op") == "stacks":
            dumps = supervisor.dump_stacks(STACKS_TIMEOUT_S)
            return {"stacks": {str(rank): [host, dump] for rank, (host, dump) in dumps.items()}}
        if request.get("op") == "stats":
            rows = supervisor.stats(STATS_TIMEOUT_S)
            return {"ranks": {str(rank): row for rank, row in rows.items()}}
        return {"error": f"unknown request {request.get('op')!r}"}

    try:
        return ControlServer(job.path / SOCKET_NAME, answer)
    except OSError as exc:  # e.g. a path longer than a Unix socket's 107 bytes
        LOG.debug("no control socket in %s: %s", job.path, exc)
        return None


def stuck_where(groups: Sequence[StackGroup]) -> str:
    """``ranks 0-6 in all_reduce (train.py:9), rank 7 in load (data.py:4)``."""
    parts = []
    for group in groups:
        who = (
            f"rank {group.ranks[0]}" if len(group.ranks) == 1 else f"ranks {rank_set(group.ranks)}"
        )
        if group.frames:
            name, path, line = group.frames[0]
            parts.append(f"{who} in {name} ({Path(path).name}:{line})")
        else:
            parts.append(f"{who}: {group.error or 'no stack'}")
    return ", ".join(parts)


def attempt_end(result: JobResult, out_of_time: bool = False) -> AttemptEnd:
    return AttemptEnd(
        result.exit_code,
        interrupted=result.interrupt is not None,
        failed_rank=result.failure.rank if result.failure else None,
        out_of_time=out_of_time,
        hosts_changed=result.rescale is not None and result.failure is None,
    )


def attempt_record(result: JobResult) -> dict[str, object]:
    """How an attempt ended, for attempts.json."""
    failure = result.failure
    return {
        "ended": time.time(),
        "exit_code": result.exit_code,
        "failure": None
        if failure is None
        else {
            "rank": failure.rank,
            "host": failure.host,
            "status": failure.status,
            "cause": failure.cause,
        },
        "failed_hosts": sorted(result.failed_hosts),
    }


def host_names(plan: Plan) -> list[str]:
    return [h.name for h in plan.hosts]


def names_mpi4py(argv: Sequence[str], cwd: str) -> bool:
    """Does the command look like an mpi4py program (so it needs --mpi)?  (It reads the
    script: the job layer's, not a pure module's.)"""
    if any("mpi4py" in arg for arg in argv[:3]):
        return True
    for arg in argv[:3]:
        if arg.endswith(".py"):
            try:
                with open(os.path.join(cwd, arg), "rb") as f:
                    return b"mpi4py" in f.read(256 * 1024)
            except OSError:
                return False
    return False


def interpreter_note(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """``python ...`` from a virtual environment that is not first on PATH: the ranks get
    PATH's python, not the environment's (a classic surprise): say which."""
    if not command or command[0] not in ("python", "python3") or sys.prefix == sys.base_prefix:
        return None
    found = find_program(command[0], environ.get("PATH"))
    ours = Path(sys.executable).parent
    if found is None or Path(found).parent.resolve() == ours.resolve():
        return None
    return (
        f"dtrain: note: the ranks' {command[0]} is {found} (first on PATH), not the one of "
        f"the virtual environment dtrain runs from ({ours}); activate it, or run the script "
        "without 'python' to use dtrain's"
    )


def restart_notice(result: JobResult, after: RestartAfter, max_restarts: int, attempt: int) -> str:
    failure = result.failure
    what = (
        f"rank {failure.rank} on {failure.host} {failure.cause or describe_status(failure.status)}"
        if failure
        else f"exit code {result.exit_code}"
    )
    return (
        f"dtrain: attempt {attempt} failed ({what}); restart {after.attempt} of "
        f"{max_restarts} in {after.delay_s:g} s"
    )


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job: plan -> survey -> bind GPUs -> specs -> dry run or supervise."""

    config: JobConfig
    environ: Mapping[str, str]
    frontend: Frontend
    job_id: str
    extra: Mapping[str, str]  # resolved -x and --env-file
    workdir: str
    output_dir: Path | None
    survey: SurveyHosts
    transports: OpenTransport
    clock: Clock | None = None
    checkpoint_dir: str | None = None  # DTRAIN_CHECKPOINT_DIR
    number: int = 0  # 0: the first attempt; n: the n-th restart
    avoid_ports: frozenset[int] = frozenset()  # rendezvous ports of the attempts before
    excluded: frozenset[str] = frozenset()  # hosts that failed in the attempts before
    world_size: int | None = None  # a restart's size when it may not change (not elastic)
    cancelled: threading.Event | None = None  # set: a signal came while a restart was surveyed
    spent_s: float = 0.0  # the attempts before took this long (--timeout is for the whole job)
    charged: int = 0  # restarts after failures so far (what --max-restarts counts)

    def survey_hosts(self, plan: Plan) -> Survey:
        """The survey; in a restart, given up at once when a signal comes (connecting to a
        host that stopped answering may take --ssh-timeout): what it opened later closes
        when dtrain exits, and the hosts' agents go with their connections."""
        if self.cancelled is None:
            return self.survey(plan, self.config, self.environ, self.workdir)
        done, found = threading.Event(), list[Survey | BaseException]()

        def work() -> None:
            try:
                found.append(self.survey(plan, self.config, self.environ, self.workdir))
            except BaseException as exc:  # raised again in the attempt's thread
                found.append(exc)
            done.set()

        threading.Thread(target=work, name="dtrain-survey", daemon=True).start()
        while not done.wait(0.05):
            if self.cancelled.is_set():
                raise LauncherError("dtrain was signalled while the restart was being prepared")
        if isinstance(found[0], BaseException):
            raise found[0]
        return found[0]

    def run(self) -> JobOutcome:
        config = self.config
        plan = plan_job(config, self.environ, excluded=self.excluded)
        LOG.debug("job %s: plan %s", self.job_id, describe_plan(plan))
        if self.world_size is not None and plan.world_size != self.world_size:
            raise PlanError(
                f"{plan.world_size} rank(s) fit on the hosts left "
                f"({', '.join(h.name for h in plan.hosts)}), not {self.world_size}",
                "allow a smaller job with --min-np",
            )
        surveyed = self.survey_hosts(plan)
        try:
            if surveyed.site.remote_hosts and isinstance(config.placement.nproc_per_node, str):
                plan = plan_job(config, self.environ, surveyed.site, self.excluded)  # counted
                LOG.debug("plan by the hosts' GPUs and cores: %s", describe_plan(plan))
            if self.cancelled is not None and self.cancelled.is_set():
                raise LauncherError("dtrain was signalled while the restart was being prepared")
            plan = bind_job_gpus(plan, surveyed, config)
            plan = bind_cpus(plan, surveyed.site.cpus, config.placement.bind_to)
            if config.placement.report_bindings:
                for line in describe_bindings(plan):
                    self.frontend.notice(line)
            if not config.dry_run:
                program = () if config.module else config.command  # a module: Python finds it
                check_local_program(plan, surveyed.site, program, self.workdir, self.environ)
            specs = build_job_specs(
                plan,
                surveyed.site,
                config,
                job_id=self.job_id,
                extra=self.extra,
                environ=self.environ,
                cwd=self.workdir,
                server=builtin_server(config),
                attempt=self.number,
                avoid_ports=self.avoid_ports,
                checkpoint_dir=self.checkpoint_dir,
            )
            if config.mpi is not None:
                return self.run_mpi(plan, surveyed, specs)
            if names_mpi4py(config.command, self.workdir):
                self.frontend.notice(MPI4PY_WARNING)
            if config.dry_run:
                return DryRun(describe_specs(specs))
            transport = self.transports(surveyed, config, self.environ)
            # A standing cluster's chief is the user's coordinator: not started here.
            started = [s for s in specs if not (config.standing_cluster and s.role == "chief")]
            port = int(specs[0].env["MASTER_PORT"])
            remote = bool(surveyed.site.remote_hosts)
            result = self.supervise(plan, specs, started, transport, remote=remote)
            failed = result.failed_hosts & surveyed.site.remote_hosts  # never this machine
            return Finished(result, port, failed)
        finally:
            surveyed.close()

    def run_mpi(self, plan: Plan, surveyed: Survey, specs: Sequence[LaunchSpec]) -> JobOutcome:
        """One mpirun under the supervisor, its output split back by rank."""
        from launcher.run.mpi import mpi_launch

        with mpi_launch(self.config, plan, surveyed.site, specs, self.environ) as launch:
            if self.config.dry_run:
                return DryRun(
                    describe_specs(specs), launch.argv, launch.hostfile_text, launch.spec.env
                )
            transport = self.transports(None, self.config, self.environ)
            remote = bool(surveyed.site.remote_hosts)
            stacks = mpi_stacks(self.job_id, plan, surveyed)
            try:
                result = self.supervise(
                    plan, specs, [launch.spec], transport, launch.spec, remote, stacks,
                    surveyed.lost_hosts,
                )  # fmt: skip
            finally:  # mpirun is gone: whatever it left of the ranks goes too
                for host, pids in kill_mpi_leftovers(self.job_id, plan, surveyed).items():
                    self.frontend.notice(
                        f"dtrain: mpirun left {len(pids)} process(es) of the job on {host} "
                        f"(pids {', '.join(map(str, pids[:8]))}): killed them"
                    )
            port = int(specs[0].env["MASTER_PORT"]) if "MASTER_PORT" in specs[0].env else None
            return Finished(result, port, result.failed_hosts & surveyed.site.remote_hosts)

    def supervise(
        self,
        plan: Plan,
        specs: Sequence[LaunchSpec],
        started: Sequence[LaunchSpec],
        transport: Transport,
        mpi_launcher: LaunchSpec | None = None,
        remote: bool = False,
        stacks: StacksSource | None = None,
        lost_hosts: Callable[[], Mapping[str, str]] | None = None,
    ) -> JobResult:
        """Run ``started`` under the supervisor; the job directory records, the view shows
        (``stacks``: under --mpi, how to find the ranks' stacks where mpirun started them;
        ``lost_hosts``: the hosts lost while mpirun ran)."""
        config = self.config
        job = self.open_job_dir(plan)
        recorder = JobRecorder(job)
        recorder.write_plan(describe_specs(specs, hidden=self.extra.keys()))
        recorder.write_status("running", None)
        if config.several_attempts:
            record_attempt(
                job,
                self.number,
                {"started": time.time(), "world_size": plan.world_size, "hosts": host_names(plan)},
            )
        if config.standing_cluster:
            self.announce_cluster(job, specs)
        view, showing = self.frontend.open_view(
            self.job_id, plan, remote=remote, attempt=self.number
        )
        journal: OutputSink = recorder
        if mpi_launcher is not None:  # mpirun's tagged lines, split back per rank for each sink
            from launcher.run.mpi import MpiOutput, rank_specs

            journal = mpi_output = MpiOutput(recorder, rank_specs(plan, specs[0]), mpi_launcher)
            view = MpiOutput(view, rank_specs(plan, specs[0]), mpi_launcher)
        view_outlet = Outlet(
            view,
            name="terminal view",
            lossy=config.view.lossy,
            patience_s=VIEW_PATIENCE_S,
            on_drop=self.report_drops,
        )
        output = Fanout([Outlet(journal, name="job directory"), view_outlet])
        supervisor = self.make_supervisor(job, plan, started, transport, output, mpi_launcher)
        supervisor.stacks = stacks
        showing.__enter__()
        result: JobResult | None = None
        control = open_control(job, supervisor)
        watching = self.watch_discovery(supervisor, plan)
        try:
            result = supervisor.run()
            if mpi_launcher is not None:
                from launcher.run.mpi import mpi_failure, mpi_hosts_lost

                result = mpi_failure(result, mpi_output, plan)
                lost = lost_hosts() if lost_hosts is not None else {}
                result = mpi_hosts_lost(result, lost, mpi_output, plan)
        except BaseException:
            recorder.finish_error()  # the record says how it ended, whatever happened
            output.give_up_views()
            raise
        finally:
            watching.set()
            if control is not None:
                control.close()
            self.end_attempt(job, recorder, result, output, showing, supervisor)
        if view_outlet.failed:
            self.frontend.notice(
                f"dtrain: warning: the terminal view failed ({view_outlet.error!r}); the job "
                f"went on without it: dtrain logs {self.job_id} shows every line"
            )
        return result

    def make_supervisor(
        self,
        job: JobDir,
        plan: Plan,
        started: Sequence[LaunchSpec],
        transport: Transport,
        output: Fanout,
        mpi_launcher: LaunchSpec | None,
    ) -> Supervisor:
        config = self.config
        tf_ps = config.tf_ps and mpi_launcher is None
        return Supervisor(
            started,
            transport,
            output,
            grace_s=config.grace_s,
            clock=self.clock,
            output_dir=self.output_dir,
            roles={s.rank: s.role for s in started} if tf_ps else None,
            worker_restarts=config.ps.restart_workers if config.ps is not None else 0,
            limits=TimeLimits(
                hang_s=config.hang_timeout_s,
                fail_on_hang=config.on_hang == "fail",
                start_s=config.start_timeout_s,
                total_s=(
                    None
                    if config.time_limit_s is None
                    else max(0.0, config.time_limit_s - self.spent_s)
                ),
                timeout_s=config.time_limit_s,
                on_hang=lambda dumps: self.report_hang(job, dumps, plan.world_size),
            ),
            on_stopping=self.frontend.notice,
            append_output=self.number > 0,
        )

    def record_end(self, outcome: JobOutcome) -> None:
        """The job ends with this attempt after all (a restart that could not be): its state
        in the job directory goes from restarting to how the attempt ended."""
        if isinstance(outcome, Finished):
            job = JobDir(jobs_root(self.config.job_dir, self.environ) / self.job_id)
            end_record(job, outcome.result.exit_code)

    def end_attempt(
        self,
        job: JobDir,
        recorder: JobRecorder,
        result: JobResult | None,
        output: Fanout,
        showing: AbstractContextManager[Any],
        supervisor: Supervisor,
    ) -> None:
        """The record first (a terminal that does not read must not leave it "running"),
        then the view; a signal in between is caught and cuts the view's wait short."""
        late = threading.Event()
        with caught_signals(lambda signum: late.set(), enabled=True):
            if result is not None:
                stopped = (job.path / STOP_MARK).exists()
                recorder.finish(result, stopped, restarting=self.restarts_after(result))
                if self.config.several_attempts:
                    record_attempt(job, self.number, attempt_record(result))
            self.finish_view(output, showing, supervisor.stop_requested, late)

    def watch_discovery(self, supervisor: Supervisor, plan: Plan) -> threading.Event:
        """With --host-discovery-script: run it every few seconds while the attempt runs;
        when a host of the job leaves its list, or an elastic job could grow, stop the attempt
        (the job starts again on the hosts given, not counted as a restart).  Set the event
        returned to stop watching."""
        done = threading.Event()
        placement = self.config.placement
        script = placement.host_discovery_script
        if script is None or self.config.dry_run:
            return done
        running: dict[str, int] = {}
        for rank in plan.ranks:
            running[rank.host.name] = running.get(rank.host.name, 0) + 1
        grow_to = placement.max_np or placement.np or sum(h.slots for h in plan.hosts) * 1000

        def watch() -> None:
            while not done.wait(DISCOVERY_POLL_S):
                try:
                    found = {h.name: h.slots for h in discover_hosts(script)}
                except LauncherError as exc:
                    LOG.warning("%s (the hosts stay as they are)", exc.message)
                    continue
                change = discovery_change(running, found, self.excluded, plan.world_size, grow_to)
                if change is not None:
                    supervisor.rescale(change)
                    return

        threading.Thread(target=watch, name="dtrain-discovery", daemon=True).start()
        return done

    def restarts_after(self, result: JobResult) -> bool:
        """Will the job start again after this result (--max-restarts)?"""
        config = self.config
        return (
            decide_restart(attempt_end(result), self.charged, config.max_restarts, 0.0) is not None
        )

    def finish_view(
        self,
        output: Fanout,
        showing: AbstractContextManager[Any],
        interrupted: bool,
        stop: threading.Event | None = None,
    ) -> None:
        """Let the terminal show what is left: as long as it takes, unless dtrain is signalled
        (before, ``stop`` already set, or now), when a view that does not keep up is left
        behind."""
        stop = stop or threading.Event()
        with caught_signals(lambda signum: stop.set(), enabled=True):
            done = output.finish_views(interrupted or stop.is_set(), stop)
        if done:  # a view still stuck on a paused terminal would hang here: left behind
            try:
                showing.__exit__(None, None, None)
            except (OSError, ValueError):
                pass  # the terminal is gone (closed window, hung-up session)

    def announce_cluster(self, job: JobDir, specs: Sequence[LaunchSpec]) -> None:
        """Tell how a coordinator on this machine joins the standing cluster (and keep it in
        the job directory, for a detached job)."""
        tf_config = next(s.env["TF_CONFIG"] for s in specs if s.role == "chief")
        export = f"export TF_CONFIG='{tf_config}' GRPC_FAIL_FAST=use_caller"
        write_json(job.path / "tf_config.json", json.loads(tf_config))
        with open_private(job.path / "coordinator.sh", "wb") as f:
            f.write(f"{export}\n".encode())
        cluster = json.dumps(json.loads(tf_config)["cluster"], separators=(",", ":"))
        for line in (
            f"dtrain: TensorFlow cluster: {cluster}",
            "dtrain: run your coordinator (ParameterServerStrategy) on this machine with:",
            f"    {export}",
            f"dtrain: (also in {job.path / 'coordinator.sh'}); the cluster serves until "
            f"Ctrl-C or dtrain stop {self.job_id}",
        ):
            self.frontend.notice(line)

    def report_hang(
        self, job: JobDir, dumps: Mapping[int, tuple[str, Mapping[str, Any]]], world: int
    ) -> str:
        """A hang: every rank's stack to the terminal and to the job directory; returns where
        the ranks were, for the summary."""
        from launcher.core.stacks import format_stacks, group_stacks

        groups = group_stacks(dumps)
        text = format_stacks(groups, world)
        path = job.path / "stacks.txt"
        try:
            with open_private(path, "ab") as f:
                f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
                f.write(("\n".join(text) + "\n").encode())
        except OSError:
            pass  # a full disk: the terminal still shows them
        silent = self.config.hang_timeout_s
        self.frontend.notice(f"dtrain: no output from any rank for {silent:g} s; their stacks:")
        for line in text:
            self.frontend.notice("    " + line if line else "")
        self.frontend.notice(f"dtrain: (also in {path})")
        return ": " + stuck_where(groups) if groups else ""

    def report_drops(self, count: int) -> None:
        self.frontend.notice(
            f"dtrain: the terminal fell behind: {count} line(s) not shown "
            f"(--lossy-view; dtrain logs {self.job_id} has every line)"
        )

    def open_job_dir(self, plan: Plan) -> JobDir:
        root = jobs_root(self.config.job_dir, self.environ)
        meta = {
            "id": self.job_id,
            "command": list(self.config.command),
            "cwd": self.workdir,
            "hosts": [h.name for h in plan.hosts],
            "world_size": plan.world_size,
            "grace_s": self.config.grace_s,
            "mpi": self.config.mpi is not None,
            "launcher_pid": os.getpid(),
        }
        if (root / self.job_id).is_dir():  # made by --detach before this launcher started
            write_json(root / self.job_id / "meta.json", meta)
            return JobDir(root / self.job_id)
        return JobDir.create(root, self.job_id, meta)


def with_hostfile_shorthand(config: JobConfig, frontend: Frontend) -> JobConfig:
    """``-H hosts`` naming a file here reads it as the hostfile (as DeepSpeed's -H does)."""
    path = hostfile_shorthand(config.placement.host_lists)
    if path is None:
        return config
    frontend.notice(shorthand_notice(path))
    return replace(config, placement=replace(config.placement, host_lists=(), hostfile=path))


def plan_job(
    config: JobConfig,
    environ: Mapping[str, str],
    site: Site | None = None,
    excluded: Collection[str] = (),
) -> Plan:
    """Where the ranks go: -H/--hostfile (or localhost, or the discovery script's hosts), less
    the ``excluded`` (failed) hosts, and the placement options.

    ``--nproc-per-node auto|gpu|cpu`` counts each host's GPUs or cores: this machine's at
    once, other hosts' from the survey's ``site`` (before it: one rank per host, so that
    the survey knows where to go).
    """
    if config.ps is not None:
        return plan_parameter_servers(config, environ)
    placement = config.placement
    per_node = placement.nproc_per_node
    default_slots = placement.np or (per_node if isinstance(per_node, int) else None)
    local_gpus = detect_local_gpus(environ) if placement.gpu_binding else ()
    if default_slots is None and not placement.hosts_given:
        # One rank per local GPU, as torchrun's --nproc-per-node gpu; else one.
        default_slots = len(local_gpus) or 1
    hosts = job_hosts(config, environ, default_slots)
    # Failed hosts go first: --nnodes N then takes the first N of the healthy ones (spares
    # listed after them stand in for a failed host).
    healthy = healthy_hosts(hosts, excluded)
    try:
        hosts = select_hosts(healthy, placement.nnodes, placement.include, placement.exclude)
    except PlanError as exc:
        if len(healthy) == len(hosts):
            raise
        left_out = ", ".join(sorted(h.name for h in hosts if h not in healthy))
        raise PlanError(f"{exc.message} (after leaving out {left_out}: failed)", exc.hint) from None
    np = placement.np
    if placement.elastic:
        np = elastic_np(hosts, placement.np, placement.min_np, placement.max_np)
    counts: int | list[int] | None = per_node if isinstance(per_node, int) else None
    if isinstance(per_node, str):
        here = {h.name: is_local_address(h.name) for h in hosts}
        gpus = {name: local_gpus for name, local in here.items() if local}
        cpus = {name: tuple((c, 0) for c in os.sched_getaffinity(0)) for name in gpus}
        if site is not None:
            gpus, cpus = {**site.gpus, **gpus}, {**site.cpus, **cpus}
        counts = per_node_counts(hosts, per_node, gpus, cpus)
        if site is None:  # other hosts: one rank each until the survey has counted
            counts = [n if here[h.name] else 1 for n, h in zip(counts, hosts, strict=True)]
    return plan_ranks(
        hosts,
        np,
        map_by=placement.map_by,
        oversubscribe=placement.oversubscribe,
        nproc_per_node=counts,
    )


def healthy_hosts(hosts: Sequence[Host], excluded: Collection[str]) -> list[Host]:
    """The hosts less those that failed in an earlier attempt."""
    left = [h for h in hosts if h.name not in excluded]
    if not left:
        raise PlanError(
            f"no host left: {', '.join(sorted(excluded))} failed",
            "check the hosts (dtrain check), or let them back with --blacklist-cooldown",
        )
    return left


def job_hosts(
    config: JobConfig, environ: Mapping[str, str], default_slots: int | None
) -> list[Host]:
    """The hosts: the discovery script's, -H/--hostfile, the Slurm allocation's, or localhost."""
    placement = config.placement
    if placement.host_discovery_script is not None:
        return discover_hosts(placement.host_discovery_script)
    allocation = allocation_hosts(config, environ)
    if allocation is not None:
        return list(allocation.hosts)
    return read_hosts(placement.host_lists, placement.hostfile, default_slots)


def plan_parameter_servers(config: JobConfig, environ: Mapping[str, str]) -> Plan:
    """``dtrain ps`` placement from -H/--hostfile and the optional role host lists."""
    ps, placement = config.ps, config.placement
    assert ps is not None
    hosts = job_hosts(config, environ, ps.workers)
    ps_hosts = parse_host_list(ps.ps_hosts, "--ps-hosts") if ps.ps_hosts else None
    worker_hosts = parse_host_list(ps.worker_hosts, "--worker-hosts") if ps.worker_hosts else None
    from_slurm = allocation_hosts(config, environ) is not None
    if worker_hosts is None and not placement.hosts_given and not from_slurm:
        hosts = [replace(hosts[0], slots=ps.workers)]
    return plan_ps(
        hosts,
        ps.workers,
        ps.ps_tasks,
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        chief=ps.tf,
        evaluator=ps.evaluator,
        oversubscribe=placement.oversubscribe,
        # A standing cluster's coordinator is the user's, on this machine.
        chief_host=Host("localhost") if config.standing_cluster else None,
    )


def bind_job_gpus(plan: Plan, surveyed: Survey, config: JobConfig) -> Plan:
    """CUDA_VISIBLE_DEVICES per rank from the GPUs found on each host (ps tasks: none)."""
    placement = config.placement
    if not placement.gpu_binding:
        return plan
    gpus = surveyed.site.gpus
    if config.ps is not None:
        return bind_ps_gpus(plan, gpus, placement.gpus_per_rank, config.ps.ps_gpus)
    return bind_gpus(plan, gpus, placement.gpus_per_rank)


def describe_plan(plan: Plan) -> str:
    """``4 ranks: node1 x2, node2 x2`` for --verbose."""
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.host.name] = counts.get(rank.host.name, 0) + 1
    return f"{plan.world_size} rank(s): " + ", ".join(f"{h} x{n}" for h, n in counts.items())


def describe_bindings(plan: Plan) -> list[str]:
    """``--report-bindings``: where each rank runs, on which CPUs and GPUs."""
    return [
        f"dtrain: rank {r.rank} on {r.host.name} (local rank {r.local_rank}): "
        f"cpus {','.join(map(str, r.cpus)) if r.cpus is not None else 'any'}, "
        f"gpus {','.join(r.gpus) or 'none' if r.gpus is not None else 'any'}"
        for r in plan.ranks
    ]


def builtin_server(config: JobConfig) -> ServerProgram | None:
    """``--builtin-servers`` (or no COMMAND): the TensorFlow server that ps and workers run."""
    if config.ps is None or not (config.ps.builtin_servers or config.standing_cluster):
        return None
    return ServerProgram(source=remote.source("tf_server"), local_python=sys.executable)
