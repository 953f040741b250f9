"""Running a sweep (job layer): every trial a dtrain job of its own, on free slots.

``SweepRunner`` queues the trials, starts each (``trial.py``) when the slots it
needs are free, sees them end, retries the failed ones, reads their metrics as
their logs grow and shows the table through the frontend the edge gives it.
The trials' launchers run in sessions of their own: a Ctrl-C reaches the
sweep, which passes it on to every running trial, waits for them to tear down
(then SIGKILLs what is left; their watchdogs end the ranks), and records how
each trial ended in the sweep's record (``sweeprecord.py``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from launcher.base.errors import UsageError
from launcher.core.hosts import Host
from launcher.core.sweep import (
    Placement,
    SlotPool,
    Trial,
    TrialRow,
    describe_placement,
    render_hostfile,
)
from launcher.loop.supervisor import caught_signals
from launcher.run.trial import (
    MetricScanner,
    launcher_report,
    outcome_of,
    start_trial_launcher,
    trial_config,
)
from launcher.streams.jobdir import HOSTFILE, METRICS, JobDir, open_private
from launcher.streams.joblogs import LogLine, LogReader
from launcher.streams.sweeprecord import Sweep, TrialRecord
from launcher.transport.local import detect_local_gpus, find_free_ports, is_local_address

POLL_S = 0.25  # how often the sweep looks at its trials
STOP_EXTRA_S = 15.0  # after a signal, beyond the grace period, before a trial's launcher is killed


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
        hostfile = job.path / HOSTFILE
        with open_private(hostfile, "wb") as f:
            text = render_hostfile(
                sweep.hosts, placement, self.local_gpus, sweep.base.placement.gpus_per_rank
            )
            f.write(text.encode())
        port = self.pick_port()
        trial = Trial(record.index, record.params, record.command)
        metrics = str(job.path / METRICS)
        config = trial_config(
            sweep.base,
            sweep.root,
            sweep.settings.np_per_trial,
            trial,
            job_id,
            hostfile,
            port,
            metrics,
            self.one_thread,
        )
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
