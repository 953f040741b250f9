"""One attempt of a job: plan -> survey -> specs -> supervisor -> result.

An ``Attempt`` plans the ranks, surveys the hosts (connect, probe ports, GPUs,
addresses), binds GPUs and CPUs, builds every rank's spec (pure,
``specs.build_job_specs``), then either describes it (``--dry-run``) or runs it
under the supervisor with the job directory recording everything and the terminal
(``Frontend``) showing it.  The restart loop (``run/restarts.py``) makes the next
attempt from this one with ``dataclasses.replace``; ``--mpi`` runs one mpirun
instead of the ranks (``run/mpi.py``), through the ``RankLauncher`` hooks here.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from launcher.base.clock import Clock, SystemClock
from launcher.base.errors import LauncherError, PlanError
from launcher.base.log import LOG
from launcher.core.command import LaunchSpec, describe_specs
from launcher.core.config import JobConfig
from launcher.core.env import copied_names
from launcher.core.errorfile import ERROR_FILE_VARIABLE, ERRORS_FOLDER, parse_error_file
from launcher.core.outcome import JobResult, OutputSink
from launcher.core.plan import Plan, bind_cpus
from launcher.core.policy import AttemptEnd, decide_restart
from launcher.core.specs import build_job_specs
from launcher.loop.asks import StackDumps
from launcher.loop.supervisor import Supervisor, TimeLimits, caught_signals
from launcher.run.discovery import watch_discovery
from launcher.run.inspection import HangReport, open_control
from launcher.run.namedfiles import read_head
from launcher.run.planning import (
    MPI4PY_WARNING,
    bind_job_gpus,
    builtin_server,
    describe_bindings,
    describe_plan,
    dry_run_notes,
    names_mpi4py,
    plan_job,
    plan_surveyed,
)
from launcher.run.preflight import check_local_program, not_checked_note
from launcher.run.stragglers import ProgressWatch
from launcher.run.survey import Survey
from launcher.streams.jobdir import (
    COORDINATOR,
    STOP_MARK,
    TF_CONFIG,
    JobDir,
    write_json,
    write_text,
)
from launcher.streams.joblist import jobs_root
from launcher.streams.outlets import Fanout, Outlet
from launcher.streams.recorder import JobRecorder, clear_results, end_record, record_attempt
from launcher.transport.base import Transport

VIEW_PATIENCE_S = 2.0  # after Ctrl-C/SIGTERM, how long the view may take to show what is left
SURVEY_POLL_S = 0.05  # a restart's survey: how often a signal to dtrain is looked for
MAX_ERROR_FILE_BYTES = 1 << 20  # of a rank's error file, read for the summary


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


class RankLauncher(Protocol):
    """One process that starts every rank itself (``--mpi``: mpirun), as the attempt sees it:
    its output and its result turned back into the ranks'."""

    def split_outputs(self, journal: OutputSink, view: OutputSink) -> tuple[OutputSink, OutputSink]:
        """The job directory's and the terminal's sinks, behind ones that split the
        launcher's output by rank."""
        ...

    def rank_result(self, result: JobResult) -> JobResult:
        """The launcher's result as the ranks': which rank failed first, how."""
        ...

    def dump_stacks(self, timeout_s: float) -> StackDumps:
        """The ranks' stacks, found where the launcher started them."""
        ...


@dataclass(frozen=True)
class DryRun:
    """``--dry-run``: what would run, and nothing started."""

    entries: list[dict[str, object]]  # one per rank (describe_specs)
    mpirun: list[str] | None = None  # --mpi: mpirun's command line...
    hostfile: str | None = None  # ...its hostfile...
    mpirun_env: Mapping[str, str] = field(default_factory=dict)  # ...and what it forwards


@dataclass(frozen=True)
class Finished:
    """An attempt that ran: its result, and what the next attempt needs of it."""

    result: JobResult
    master_port: int | None = None  # the attempt's rendezvous port (a restart takes another)
    failed_hosts: frozenset[str] = frozenset()  # remote hosts to leave out of a restart

    @property
    def lost_hosts(self) -> frozenset[str]:
        """The failed hosts that were lost (cut off, agent silent): ranks may still run there."""
        return self.result.lost_hosts & self.failed_hosts


JobOutcome = DryRun | Finished


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
    clock: Clock = field(default_factory=SystemClock)  # every wait and "now" of the job
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
        while not self.clock.wait(done, SURVEY_POLL_S):
            self.check_cancelled()
        if isinstance(found[0], BaseException):
            raise found[0]
        return found[0]

    def check_world_size(self, plan: Plan) -> None:
        """A restart's world size may not change unless the job is elastic."""
        if self.world_size is not None and plan.world_size != self.world_size:
            raise PlanError(
                f"{plan.world_size} rank(s) fit on the hosts left "
                f"({', '.join(h.name for h in plan.hosts)}), not {self.world_size}",
                "allow a smaller job with --min-np",
            )

    def check_cancelled(self) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise LauncherError("dtrain was signalled while the restart was being prepared")

    def run(self) -> JobOutcome:
        plan = plan_job(self.config, self.environ, excluded=self.excluded)
        LOG.debug("job %s: plan %s", self.job_id, describe_plan(plan))
        if not plan.provisional:  # (else once the survey has counted the hosts)
            self.check_world_size(plan)
        surveyed = self.survey_hosts(plan)
        try:
            return self.run_surveyed(plan, surveyed)
        finally:
            surveyed.close()

    def run_surveyed(self, plan: Plan, surveyed: Survey) -> JobOutcome:
        """The attempt once the hosts are known: bind, build the specs, run (or describe)."""
        config = self.config
        if plan.provisional:  # placed before the hosts' slots were counted: again
            plan = plan_surveyed(plan, config, self.environ, surveyed, self.excluded)
            self.check_world_size(plan)
        if config.dry_run:
            for note in dry_run_notes(plan, config):
                self.frontend.notice(note)
        self.check_cancelled()
        plan = bind_job_gpus(plan, surveyed, config)
        plan = bind_cpus(plan, surveyed.site.cpus, config.placement.bind_to)
        if config.placement.report_bindings:
            for line in describe_bindings(plan):
                self.frontend.notice(line)
        program = () if config.module else config.command  # a module: Python finds it
        check_local_program(plan, surveyed.site, program, self.workdir, self.environ)
        unchecked = [h.name for h in plan.hosts if not surveyed.site.local.get(h.name)]
        if config.dry_run and unchecked:  # (a real run's agents look on every host)
            self.frontend.notice(not_checked_note(unchecked, config.placement.master_port))
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
            job_path=str(jobs_root(config.job_dir, self.environ) / self.job_id),
        )
        if config.mpi is not None:
            return self.run_mpi(plan, surveyed, specs)
        if names_mpi4py(config.command, self.workdir):
            self.frontend.notice(MPI4PY_WARNING)
        if config.dry_run:  # (values from the environment or an env file: names only)
            return DryRun(describe_specs(specs, copied_names(config.env.exports, self.extra)))
        transport = self.transports(surveyed, config, self.environ)
        # A standing cluster's chief is the user's coordinator: not started here.
        started = [s for s in specs if not (config.standing_cluster and s.role == "chief")]
        port = int(specs[0].env["MASTER_PORT"])
        remote = bool(surveyed.site.remote_hosts)
        result = self.supervise(plan, specs, started, transport, remote=remote)
        failed = result.failed_hosts & surveyed.site.remote_hosts  # never this machine
        return Finished(result, port, failed)

    def run_mpi(self, plan: Plan, surveyed: Survey, specs: Sequence[LaunchSpec]) -> JobOutcome:
        """``--mpi``: one mpirun under the supervisor, its output split back by rank."""
        from launcher.core.mpi import rank_specs  # (these three: loaded when needed)
        from launcher.run.mpi import MpiRanks, mpi_launch
        from launcher.transport.mpi import MpirunTransport, RankCopies, kill_local_mpi_leftovers

        with mpi_launch(self.config, plan, surveyed.site, specs, self.environ) as launch:
            if self.config.dry_run:
                return DryRun(
                    describe_specs(specs), launch.argv, launch.hostfile_text, launch.spec.env
                )
            config = self.config
            transport = MpirunTransport(
                self.transports(None, config, self.environ),
                self.job_id,
                surveyed.agents,
                config.grace_s,
                launch.remote_sessions,
            )
            remote = bool(surveyed.site.remote_hosts)
            ranks = MpiRanks(self.job_id, plan, rank_specs(plan, specs[0]), launch.spec, surveyed)
            if self.output_dir is not None:
                ranks.copies = RankCopies(self.output_dir, ranks.specs, self.number > 0)
            try:
                result = self.supervise(plan, specs, [launch.spec], transport, remote, ranks)
            finally:  # mpirun is gone: whatever it left of the ranks here goes too (elsewhere,
                # each host's agent kills it when the survey closes it, right after this)
                pids = kill_local_mpi_leftovers(self.job_id)
                if pids:
                    self.frontend.notice(
                        f"dtrain: mpirun left {len(pids)} process(es) of the job on this machine "
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
        remote: bool = False,
        launcher: RankLauncher | None = None,
    ) -> JobResult:
        """Run ``started`` under the supervisor; the job directory records, the view shows
        (``launcher``: under --mpi, the one process that starts the ranks)."""
        config = self.config
        job = self.open_job_dir(plan)
        clear_error_files(job)
        clear_results(job)  # (launcher.launch's: the function's return values)
        recorder = JobRecorder(job)
        recorder.write_plan(describe_specs(specs, hidden=self.extra.keys()))
        recorder.write_status("running", None)
        if config.several_attempts:
            hosts = [h.name for h in plan.hosts]
            began = {"started": self.clock.wall(), "world_size": plan.world_size, "hosts": hosts}
            record_attempt(job, self.number, began)
        if config.standing_cluster:
            self.announce_cluster(job, specs)
        shown = plan  # the ranks the view counts: a standing cluster's coordinator is not one
        if config.standing_cluster:
            shown = Plan(tuple(r for r in plan.ranks if r.role != "chief"))
        view, showing = self.frontend.open_view(
            self.job_id, shown, remote=remote, attempt=self.number
        )
        progress = ProgressWatch(job, config, self.clock, self.frontend.notice)
        journal = progress.tap(recorder)  # every rank's steps, seen where its lines are kept
        if launcher is not None:  # its lines, split back per rank for each sink
            journal, view = launcher.split_outputs(journal, view)
        view_outlet = Outlet(
            view,
            name="terminal view",
            lossy=config.view.lossy,
            patience_s=VIEW_PATIENCE_S,
            on_drop=self.report_drops,
        )
        output = Fanout([Outlet(journal, name="job directory"), view_outlet])
        supervisor = self.make_supervisor(job, plan, started, transport, output, launcher)
        showing.__enter__()
        result: JobResult | None = None
        control = open_control(job, supervisor, progress.board)
        progress.start()
        watching = watch_discovery(
            supervisor, plan, config.placement, self.excluded, self.clock, self.frontend.notice
        )
        try:
            result = supervisor.run()
            if launcher is not None:
                result = launcher.rank_result(result)
            result = with_raised_error(result, specs)
        except BaseException:
            recorder.finish_error()  # the record says how it ended, whatever happened
            output.give_up_views()
            raise
        finally:
            watching.set()
            progress.stop()
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
        launcher: RankLauncher | None,
    ) -> Supervisor:
        config = self.config
        tf_ps = config.tf_ps and launcher is None
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
                on_hang=HangReport(
                    job,
                    plan.world_size,
                    config.hang_timeout_s or 0.0,
                    self.frontend.notice,
                    self.clock,
                ),
            ),
            on_stopping=self.frontend.notice,
            append_output=self.number > 0,
            stacks=launcher.dump_stacks if launcher is not None else None,
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
                    record_attempt(job, self.number, attempt_record(result, self.clock.wall()))
            self.finish_view(output, showing, supervisor.stop_requested, late)

    def restarts_after(self, result: JobResult) -> bool:
        """Will the job start again after this result (--max-restarts)?"""
        end = attempt_end(result)
        return decide_restart(end, self.charged, self.config.max_restarts, 0.0) is not None

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
        the job directory, for a detached job): what is to be pasted or read whole (the
        cluster, the export, the file) on lines of its own, the rest within 80 columns."""
        tf_config = next(s.env["TF_CONFIG"] for s in specs if s.role == "chief")
        export = f"export TF_CONFIG='{tf_config}' GRPC_FAIL_FAST=use_caller"
        write_json(job.path / TF_CONFIG, json.loads(tf_config))
        write_text(job.path / COORDINATOR, f"{export}\n")
        cluster = json.dumps(json.loads(tf_config)["cluster"], separators=(",", ":"))
        for line in (
            "dtrain: TensorFlow cluster:",
            f"    {cluster}",
            "dtrain: run your coordinator (ParameterServerStrategy) on this machine with:",
            f"    {export}",
            "dtrain: or with the same line, kept in the job directory:",
            f"    . {job.path / COORDINATOR}",
            "dtrain: the cluster serves until Ctrl-C, or until dtrain stop with its job id:",
        ):
            self.frontend.notice(line)

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
            return JobDir(root / self.job_id).write_meta(meta)
        return JobDir.create(root, self.job_id, meta)


def clear_error_files(job: JobDir) -> None:
    """The ranks' error files (``TORCHELASTIC_ERROR_FILE``): a folder for them, and none of
    an earlier attempt's left to be taken for this one's."""
    folder = job.path / ERRORS_FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    for old in folder.glob("rank.*.json"):
        old.unlink(missing_ok=True)


def with_raised_error(result: JobResult, specs: Sequence[LaunchSpec]) -> JobResult:
    """The result, with what the first failed rank's error file says (torch's ``@record``),
    when it wrote one."""
    failure = result.failure
    spec = next((s for s in specs if failure is not None and s.rank == failure.rank), None)
    path = spec.env.get(ERROR_FILE_VARIABLE) if spec is not None else None
    if failure is None or path is None:
        return result
    # (none written, or empty as the watchdog made it: the rank did not use @record, or
    # died by a signal; read without blocking: the rank could put anything there)
    written = read_head(path, MAX_ERROR_FILE_BYTES)
    raised = parse_error_file(written.decode(errors="replace")) if written else None
    if raised is None:
        return result
    failure = replace(failure, error=raised.message, error_at=raised.raised_at)
    return replace(result, failure=failure)


def attempt_end(result: JobResult, out_of_time: bool = False) -> AttemptEnd:
    return AttemptEnd(
        result.exit_code,
        interrupted=result.interrupt is not None,
        failed_rank=result.failure.rank if result.failure else None,
        out_of_time=out_of_time,
        hosts_changed=result.rescale is not None and result.failure is None,
    )


def attempt_record(result: JobResult, ended: float) -> dict[str, object]:
    """How an attempt ended (at ``ended``, seconds since the epoch), for attempts.json."""
    failure = result.failure
    return {
        "ended": ended,
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
