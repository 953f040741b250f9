"""Running a sweep (job layer): every trial a dtrain job of its own, on free slots.

Each trial runs as a child launcher (``python -m launcher _resume``, the
background half of ``--detach``) whose config is the sweep's with the
trial's command, its slots (a hostfile in its job directory), its own
rendezvous port and its parameters as variables.  So a trial gets dtrain's
whole job: survey, transports, watchdogs, teardown, job directory and logs
(``dtrain jobs``, ``dtrain logs``).  The children run in sessions of their
own: a Ctrl-C reaches the sweep, which passes it on to every running trial,
waits for them to tear down (then SIGKILLs what is left; their watchdogs end
the ranks), and records how each trial ended.  The sweep's record
(``<job dir root>/sweeps/<id>/sweep.json``) lists the trials, their
parameters, states, jobs and last metrics; ``--resume`` runs again those that
did not finish.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from launcher.base.errors import UsageError
from launcher.base.jobid import new_job_id
from launcher.core.config import (
    JobConfig,
    ViewConfig,
    config_from_json,
    config_to_json,
    validate_config,
)
from launcher.core.hosts import Host
from launcher.core.sweep import (
    Distribution,
    Params,
    Placement,
    SearchSpace,
    SlotPool,
    Trial,
    TrialRow,
    Value,
    describe_placement,
    parse_metric_json,
    parse_metric_line,
    plan_trials,
    render_hostfile,
    trial_env,
    trials_to_rerun,
)
from launcher.loop.supervisor import caught_signals
from launcher.run.background import start_launcher
from launcher.run.survey import hostfile_shorthand, read_hosts
from launcher.streams.jobdir import (
    ACTIVE,
    JobDir,
    LogLine,
    LogReader,
    make_private_dir,
    open_private,
    process_start,
    read_json,
    write_json,
)
from launcher.transport.local import detect_local_gpus, find_free_ports, is_local_address

POLL_S = 0.25  # how often the sweep looks at its trials
STOP_EXTRA_S = 15.0  # after a signal, beyond the grace period, before a trial's launcher is killed
SCAN_CHUNK = 1 << 20  # bytes of a trial's logs read per look (the rest on the next one)
MAX_LINE = 64 * 1024  # a longer line is skipped by the metrics reader (never held whole)
SWEEPS = "sweeps"  # under the job directory root: one directory per sweep
RECORD = "sweep.json"
METRICS_FILE = "metrics.jsonl"  # $DTRAIN_METRICS_FILE of a trial, in its job directory
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SweepSettings:
    """How trials run: ranks each, how many at once, retries, and the table's order."""

    np_per_trial: int = 1
    max_parallel: int | None = None
    retries: int = 0
    objective: str | None = None
    maximize: bool = False


@dataclass
class TrialRecord:
    """One trial, as the sweep's record keeps it."""

    index: int
    params: Params
    command: tuple[str, ...]
    state: str = "pending"  # pending, running, succeeded, failed, stopped
    exit_code: int | None = None
    duration_s: float | None = None
    metrics: dict[str, Value] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)  # one per run of the trial, latest last
    hosts: str | None = None
    error: str | None = None  # the trial's launcher's own error (it could not start, say)

    def row(self, elapsed_s: float | None = None) -> TrialRow:
        return TrialRow(
            trial=self.index,
            params=self.params,
            state=self.state,
            exit_code=self.exit_code,
            duration_s=self.duration_s if elapsed_s is None else elapsed_s,
            metrics=dict(self.metrics),
            job=self.jobs[-1] if self.jobs else None,
            hosts=self.hosts,
            tries=len(self.jobs),
        )


@dataclass
class Sweep:
    """A sweep: its directory, the config every trial starts from, hosts, trials."""

    id: str
    path: Path  # <root>/sweeps/<id>
    root: Path  # the job directory root (the trials' jobs)
    base: JobConfig
    hosts: list[Host]
    settings: SweepSettings
    space: SearchSpace
    trials: list[TrialRecord]
    state: str = "created"

    def save(self) -> None:
        exports = self.base.env.exports
        stored = replace(self.base, env=replace(self.base.env, exports=()))
        write_json(
            self.path / RECORD,
            {
                "id": self.id,
                "state": self.state,
                "launcher_pid": os.getpid(),
                "launcher_start": process_start(os.getpid()),
                "hosts": [asdict(h) for h in self.hosts],
                "settings": asdict(self.settings),
                "space": asdict(self.space),
                # -x values may be secrets: names only (--resume asks for them again).
                "exports": [e for e in exports if "=" not in e],
                "export_names": sorted(e.partition("=")[0] for e in exports if "=" in e),
                "config": config_to_json(stored),
                "trials": [asdict(t) for t in self.trials],
            },
        )

    def rows(self) -> list[TrialRow]:
        return [t.row() for t in self.trials]


class SweepFrontend(Protocol):
    """The terminal, as the edge gives it to the sweep (the job layer never prints)."""

    def showing(self) -> AbstractContextManager[Any]:
        """The context in which the live table is shown."""
        ...

    def update(self, rows: Sequence[TrialRow]) -> None:
        """The trials now (states, elapsed, last metrics)."""
        ...

    def show_line(self, trial: int, line: LogLine) -> None:
        """A line of the followed trial (--follow)."""
        ...

    def notice(self, text: str) -> None: ...


def default_slots(environ: Mapping[str, str]) -> int:
    """Without -H: one slot per GPU here, else per core."""
    return len(detect_local_gpus(environ)) or os.cpu_count() or 1


def sweep_hosts(config: JobConfig, environ: Mapping[str, str]) -> list[Host]:
    """The hosts whose slots the trials share (-H, --hostfile, ``-H FILE``, or localhost)."""
    placement = config.placement
    host_lists, hostfile = placement.host_lists, placement.hostfile
    path = hostfile_shorthand(host_lists)
    if path is not None:
        host_lists, hostfile = (), path
    return read_hosts(host_lists, hostfile, default_slots(environ))


def check_sweep(
    base: JobConfig, space: SearchSpace, settings: SweepSettings, environ: Mapping[str, str]
) -> tuple[list[Trial], list[Host]]:
    """The trials and the hosts, every option checked (an error before any trial starts)."""
    if base.placement.master_port is not None:
        raise UsageError(
            "--master-port: every trial gets a rendezvous port of its own",
            "drop --master-port; the sweep picks free ports",
        )
    trials = plan_trials(space, base.command)
    hosts = sweep_hosts(base, environ)
    check_fits(hosts, settings)
    probe = Sweep("check", Path(), Path(), base, hosts, settings, space, [])
    for trial in trials[:1]:  # a trial's options are checked as dtrain run checks them
        validate_config(trial_config(probe, trial, "check", Path("hosts"), 1, "metrics"))
    return trials, hosts


def create_sweep(
    base: JobConfig,
    space: SearchSpace,
    settings: SweepSettings,
    root: Path,
    environ: Mapping[str, str],
) -> Sweep:
    """Check everything, then record the sweep and its trials (all pending)."""
    trials, hosts = check_sweep(base, space, settings, environ)
    sweep_id = new_job_id()
    records = [TrialRecord(t.index, t.params, t.command) for t in trials]
    sweep = Sweep(sweep_id, root / SWEEPS / sweep_id, root, base, hosts, settings, space, records)
    try:
        make_private_dir(sweep.path, exist_ok=False)
        sweep.save()
    except OSError as exc:
        raise UsageError(
            f"--job-dir {root}: cannot create the sweep's directory ({exc.strerror})",
            "give a directory you can write to",
        ) from None
    return sweep


def check_fits(hosts: Sequence[Host], settings: SweepSettings) -> None:
    total = sum(h.slots for h in hosts)
    if settings.np_per_trial > total:
        raise UsageError(
            f"--np-per-trial {settings.np_per_trial}: the hosts have {total} slot(s)",
            "lower --np-per-trial, or give more hosts or slots with -H",
        )


def choose_seed() -> int:
    """A seed for --random without --seed (recorded, so the draws can be had again)."""
    return random.SystemRandom().randrange(2**31)


def find_sweep(root: Path, wanted: str) -> Path:
    """The directory of the sweep named (or uniquely prefixed) by ``wanted``."""
    base = root / SWEEPS
    if not wanted.strip():
        raise UsageError(f"--resume {wanted!r}: no sweep id", "give the id dtrain sweep printed")
    found = sorted(p for p in base.glob("*") if (p / RECORD).is_file()) if base.is_dir() else []
    matches = [p for p in found if p.name == wanted] or [
        p for p in found if p.name.startswith(wanted)
    ]
    if len(matches) != 1:
        what = "no sweep" if not matches else f"{len(matches)} sweeps"
        raise UsageError(
            f"--resume {wanted}: {what} matching it in {base}",
            "give the id dtrain sweep printed (see the directories there)",
        )
    return matches[0]


def load_sweep(
    root: Path,
    wanted: str,
    exports: Sequence[str],
    hosts: Sequence[Host] | None,
    overrides: Mapping[str, Any],
) -> Sweep:
    """A recorded sweep, for ``--resume``: its config with the -x values given again, and
    the hosts and settings the resume command line gives instead of the recorded ones."""
    path = find_sweep(root, wanted)
    record = read_json(path / RECORD) or {}
    pid, started = int(record.get("launcher_pid", 0)), record.get("launcher_start")
    if record.get("state") == "running" and pid != os.getpid() and process_start(pid) == started:
        raise UsageError(f"sweep {path.name} is running (pid {pid})", "let it end, or stop it")
    given = {e.partition("=")[0] for e in exports}
    missing = [name for name in record.get("export_names", []) if name not in given]
    if missing:
        raise UsageError(
            f"--resume {path.name}: the sweep had -x {', '.join(missing)} with values, which "
            "are not recorded",
            "give them again: " + " ".join(f"-x {name}=..." for name in missing),
        )
    base = config_from_json(record["config"])
    base = replace(base, env=replace(base.env, exports=(*record.get("exports", []), *exports)))
    settings = replace(SweepSettings(**record["settings"]), **overrides)
    sweep = Sweep(
        id=path.name,
        path=path,
        root=root,
        base=base,
        hosts=list(hosts) if hosts else [Host(**h) for h in record["hosts"]],
        settings=settings,
        space=space_from_json(record["space"]),
        trials=[trial_from_json(t) for t in record["trials"]],
    )
    check_fits(sweep.hosts, settings)
    return sweep


def space_from_json(data: Mapping[str, Any]) -> SearchSpace:
    return SearchSpace(
        grid=tuple((str(name), tuple(values)) for name, values in data["grid"]),
        params=tuple(
            (str(name), Distribution(d["kind"], tuple(d["args"]))) for name, d in data["params"]
        ),
        random_count=int(data["random_count"]),
        seed=int(data["seed"]),
    )


def trial_from_json(data: Mapping[str, Any]) -> TrialRecord:
    return TrialRecord(
        **{
            **data,
            "params": tuple((str(k), str(v)) for k, v in data["params"]),
            "command": tuple(data["command"]),
            "jobs": list(data["jobs"]),
            "metrics": dict(data["metrics"]),
        }
    )


def trial_config(
    sweep: Sweep,
    trial: Trial,
    job_id: str,
    hostfile: Path,
    port: int,
    metrics: str,
    one_thread: bool = False,
) -> JobConfig:
    """The trial's dtrain job: the sweep's config with its command, slots, port and variables
    (with ``one_thread``, OMP_NUM_THREADS=1), and nothing shown (the job directory keeps
    every line)."""
    base = sweep.base
    variables = {**trial_env(trial), "DTRAIN_METRICS_FILE": metrics}
    if one_thread:  # trials side by side, each with a thread per core, would thrash the host
        variables["OMP_NUM_THREADS"] = "1"
    exports = (*base.env.exports, *(f"{k}={v}" for k, v in variables.items()))
    return replace(
        base,
        command=trial.command,
        placement=replace(
            base.placement,
            host_lists=(),
            hostfile=str(hostfile),
            np=sweep.settings.np_per_trial,
            master_port=port,
        ),
        env=replace(base.env, exports=exports),
        view=ViewConfig(quiet=True, color=False, plain=True),
        job_id=job_id,
        job_dir=str(sweep.root),
        detach=False,
        dry_run=False,
        verbose=False,
    )


def end_with_parent() -> None:
    """In a trial's launcher before it runs: SIGTERM when the sweep dies (even by SIGKILL), so
    that it tears its trial down."""
    with contextlib.suppress(OSError, AttributeError):
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def start_trial_launcher(config: JobConfig, job: JobDir, environ: Mapping[str, str]) -> Any:
    """The trial's launcher, in a session of its own, its own output to launcher.log; it
    ends with the sweep (PR_SET_PDEATHSIG) where Linux offers it."""
    return start_launcher(config, job, environ, end_with_parent if LIBC is not None else None)


class MetricScanner:
    """A trial's metrics from its rank logs (``metric:`` lines) and its metrics file (JSON
    lines), read a chunk at a time from where it stopped; a line too long is skipped."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.skipping: set[Path] = set()
        self.metrics: dict[str, Value] = {}

    def files(self) -> list[Path]:
        logs = sorted(self.job.path.glob("rank.*.log"))
        extra = self.job.path / METRICS_FILE
        return logs + ([extra] if extra.is_file() else [])

    def scan(self, until_end: bool = False) -> None:
        """New lines of every file (with ``until_end``: all there is now)."""
        for path in self.files():
            while self.read_chunk(path) and until_end:
                pass

    def read_chunk(self, path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read(SCAN_CHUNK)
        except OSError:
            return False
        self.offsets[path] = self.offsets.get(path, 0) + len(data)
        if path in self.skipping:  # the rest of a line too long to keep
            cut = data.find(b"\n")
            if cut < 0:
                return bool(data)
            self.skipping.discard(path)
            data = data[cut + 1 :]
        *lines, rest = (self.partial.pop(path, b"") + data).split(b"\n")
        if len(rest) > MAX_LINE:
            self.skipping.add(path)
        elif rest:
            self.partial[path] = rest
        for line in lines:
            self.take_line(path, line)
        return bool(data)

    def take_line(self, path: Path, line: bytes) -> None:
        if path.name == METRICS_FILE:
            self.metrics.update(parse_metric_json(line.decode(errors="replace")))
        elif b"metric:" in line:
            text = line.split(b" ", 2)[-1]  # after "<time> <o|e> "
            self.metrics.update(parse_metric_line(text.decode(errors="replace")))


@dataclass
class Running:
    """A trial whose launcher runs."""

    record: TrialRecord
    trial: Trial
    process: Any  # subprocess.Popen
    job: JobDir
    placement: Placement
    port: int
    started: float
    scanner: MetricScanner


def launcher_report(job: JobDir) -> tuple[list[str], str | None]:
    """What the trial's launcher said (launcher.log's end): its notes and warnings, and why
    the trial failed, in one line (its error, or the failed rank and its last line)."""
    try:
        with open(job.path / "launcher.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return [], None
    notes = [ln for ln in lines if ln.startswith(("dtrain: note", "dtrain: warning"))]
    error = next((ln for ln in reversed(lines) if ln.startswith("dtrain: error")), None)
    failed = next((ln for ln in lines if ln.startswith("dtrain: rank ")), None)
    if error is None and failed is not None:
        last = next((ln.strip() for ln in reversed(lines) if ln.startswith("    ")), None)
        error = failed.removeprefix("dtrain: ").split(";")[0] + (f": {last}" if last else "")
    return notes, error


def outcome_of(job: JobDir, returncode: int, stopping: bool) -> tuple[str, int]:
    """A finished trial's state and exit code, from its job's record (or its launcher's
    exit code when it recorded none)."""
    status = job.status()
    state = status.get("state")
    code = status.get("exit_code")
    code = int(code) if isinstance(code, int) and state not in ACTIVE else returncode
    if code < 0:  # the launcher itself was killed by a signal
        code = 128 - code
    if state == "succeeded" and code == 0:
        return "succeeded", 0
    if stopping or state in ("stopped", "interrupted"):
        outcome = "stopped"
    else:
        outcome = "failed" if code != 0 else "succeeded"
    if state in ACTIVE or state is None:  # its launcher never recorded the end: we do
        status.update(state="stopped" if outcome == "stopped" else "failed", exit_code=code)
        with contextlib.suppress(OSError):
            write_json(job.path / "status.json", status)
    return outcome, code


class SweepRunner:
    """The sweep's loop: start what fits, see what ended, read metrics, show the table."""

    def __init__(
        self,
        sweep: Sweep,
        environ: Mapping[str, str],
        frontend: SweepFrontend,
        follow: int | None = None,
    ) -> None:
        self.sweep = sweep
        self.environ = environ
        self.frontend = frontend
        self.follow = follow
        self.pool = SlotPool(sweep.hosts)
        self.queue: collections.deque[TrialRecord] = collections.deque()
        self.running: dict[int, Running] = {}
        self.signals: list[int] = []
        self.woken = threading.Event()
        self.kill_at: float | None = None
        self.forwarded = 0
        self.reader: LogReader | None = None
        self.tries: dict[int, int] = {}  # runs of each trial in this sweep run
        self.notes: set[str] = set()
        self.local_gpus = self.find_local_gpus()
        given = {e.partition("=")[0] for e in sweep.base.env.exports}
        self.one_thread = "OMP_NUM_THREADS" not in environ and "OMP_NUM_THREADS" not in given

    def find_local_gpus(self) -> dict[int, tuple[str, ...]]:
        """GPUs of this machine, for each host of the sweep that is this machine."""
        if not self.sweep.base.placement.gpu_binding:
            return {}
        local = [i for i, h in enumerate(self.sweep.hosts) if h.gpus is None and is_local(h)]
        found = detect_local_gpus(self.environ) if local else ()
        return {i: found for i in local} if found else {}

    def run(self, indices: Sequence[int]) -> int:
        """Run these trials (all queued at once, in order); the exit code: 0 when all succeed,
        1 when one failed, 128+N when signal N stopped the sweep."""
        for record in self.sweep.trials:
            if record.index in indices:
                record.state, record.exit_code, record.error = "pending", None, None
                self.queue.append(record)
        self.sweep.state = "running"
        self.sweep.save()

        def on_signal(signum: int) -> None:
            self.signals.append(signum)
            self.woken.set()

        try:
            with caught_signals(on_signal), self.frontend.showing():
                self.loop()
        finally:
            self.end_all()
        return self.exit_code()

    def loop(self) -> None:
        while True:
            self.pass_signals()
            if not self.signals:
                self.start_ready()
            self.reap()
            self.read_output()
            self.frontend.update(self.live_rows())
            if not self.running and (self.signals or not self.queue):
                return
            self.woken.wait(POLL_S)
            self.woken.clear()

    def exit_code(self) -> int:
        if self.signals:
            return 128 + self.signals[0]
        return 0 if all(t.state == "succeeded" for t in self.sweep.trials) else 1

    def live_rows(self) -> list[TrialRow]:
        now = time.monotonic()
        return [
            t.row(now - self.running[t.index].started) if t.index in self.running else t.row()
            for t in self.sweep.trials
        ]

    def start_ready(self) -> None:
        cap = self.sweep.settings.max_parallel
        while self.queue and (cap is None or len(self.running) < cap):
            placement = self.pool.take(self.sweep.settings.np_per_trial)
            if placement is None:
                return  # the trial waits for slots
            record = self.queue.popleft()
            self.tries[record.index] = self.tries.get(record.index, 0) + 1  # (a failed start too)
            try:
                self.start(record, placement)
            except (OSError, UsageError) as exc:
                self.pool.give_back(placement)
                self.finish(record, "failed", 1, None, f"dtrain: error: {exc}")

    def start(self, record: TrialRecord, placement: Placement) -> None:
        sweep = self.sweep
        runs = len(record.jobs)
        job_id = f"{sweep.id}-t{record.index}" + (f"-{runs}" if runs else "")
        job = JobDir.create(
            sweep.root, job_id, {"id": job_id, "command": list(record.command), "sweep": sweep.id}
        )
        hostfile = job.path / "hosts"
        with open_private(hostfile, "wb") as f:
            text = render_hostfile(
                sweep.hosts, placement, self.local_gpus, sweep.base.placement.gpus_per_rank
            )
            f.write(text.encode())
        port = self.pick_port()
        trial = Trial(record.index, record.params, record.command)
        metrics = str(job.path / METRICS_FILE)
        config = trial_config(sweep, trial, job_id, hostfile, port, metrics, self.one_thread)
        process = start_trial_launcher(config, job, self.environ)
        record.state, record.hosts = "running", describe_placement(sweep.hosts, placement)
        record.jobs.append(job_id)
        record.exit_code = record.duration_s = None
        record.metrics = {}
        self.running[record.index] = Running(
            record, trial, process, job, placement, port, time.monotonic(), MetricScanner(job)
        )
        if self.follow == record.index:
            self.reader = LogReader(job)
        sweep.save()

    def pick_port(self) -> int:
        """A port free here now that no running trial holds: two trials side by side never
        get the same rendezvous port (the kernel hands out a bound port to no one)."""
        held = {r.port for r in self.running.values()}
        for _ in range(100):
            port = find_free_ports(1)[0]
            if port not in held:
                return port
        raise UsageError("no free TCP port for a trial's rendezvous", "free some ports")

    def reap(self) -> None:
        for index, run in list(self.running.items()):
            code = run.process.poll()
            if code is None:
                continue
            del self.running[index]
            self.pool.give_back(run.placement)
            run.scanner.scan(until_end=True)
            run.record.metrics = dict(run.scanner.metrics)
            if self.reader is not None and self.follow == index:
                self.show_followed()
                self.reader = None
            state, exit_code = outcome_of(run.job, code, bool(self.signals))
            notes, error = launcher_report(run.job)
            for note in notes:
                if note not in self.notes:  # once a sweep: every trial's launcher says it
                    self.notes.add(note)
                    self.frontend.notice(note)
            if state != "failed":
                error = None
            self.finish(run.record, state, exit_code, time.monotonic() - run.started, error)

    def finish(
        self,
        record: TrialRecord,
        state: str,
        exit_code: int,
        duration_s: float | None,
        error: str | None,
    ) -> None:
        record.state, record.exit_code, record.duration_s = state, exit_code, duration_s
        record.error = error
        retries = self.sweep.settings.retries
        tries = self.tries.get(record.index, 1)
        if state == "failed" and not self.signals and tries <= retries:
            self.frontend.notice(
                f"dtrain: trial {record.index} failed (exit code {exit_code}); "
                f"retry {tries} of {retries}"
            )
            record.state = "pending"
            self.queue.appendleft(record)
        elif state == "failed" and error:
            self.frontend.notice(
                f"dtrain: trial {record.index}: {error.removeprefix('dtrain: ')} "
                f"(dtrain logs {record.jobs[-1] if record.jobs else '-'})"
            )
        self.sweep.save()

    def read_output(self) -> None:
        for run in self.running.values():
            run.scanner.scan()
            run.record.metrics = dict(run.scanner.metrics)
        if self.reader is not None:
            self.show_followed()

    def show_followed(self) -> None:
        assert self.reader is not None and self.follow is not None
        for line in self.reader.read_new():
            self.frontend.show_line(self.follow, line)

    def pass_signals(self) -> None:
        """Each signal the sweep got, once, to every trial's launcher; after the grace period
        and some, SIGKILL for those still there (their watchdogs end the ranks)."""
        for signum in self.signals[self.forwarded :]:
            if self.forwarded == 0:
                grace = self.sweep.base.grace_s
                self.kill_at = time.monotonic() + grace + STOP_EXTRA_S
                self.frontend.notice(
                    f"dtrain: stopping {len(self.running)} running trial(s) (grace {grace:g} s); "
                    f"{len(self.queue)} not started; Ctrl-C again to kill now"
                )
            self.forwarded += 1
            for run in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.process.pid, signum)
        if self.kill_at is not None and time.monotonic() > self.kill_at:
            for run in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.process.pid, signal.SIGKILL)

    def end_all(self) -> None:
        """However the loop ended (an error of ours too): no trial's launcher outlives it."""
        if self.running:
            for run in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.sweep.base.grace_s + STOP_EXTRA_S
            while self.running and time.monotonic() < deadline:
                self.signals = self.signals or [signal.SIGTERM]
                self.reap()
                time.sleep(POLL_S)
            for run in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.process.pid, signal.SIGKILL)
                run.process.wait()
        done = all(t.state in ("succeeded", "failed") for t in self.sweep.trials)
        self.sweep.state = "finished" if done else "interrupted"
        self.sweep.save()


def is_local(host: Host) -> bool:
    return host.name in ("localhost", "127.0.0.1") or is_local_address(host.name)


def resume_indices(sweep: Sweep, failed_too: bool) -> list[int]:
    return trials_to_rerun({t.index: t.state for t in sweep.trials}, failed_too)
