"""One trial of a sweep as a dtrain job of its own (job layer).

A trial runs as a child launcher (``python -m launcher _resume``, the background
half of ``--detach``) whose config is the sweep's with the trial's command, its
slots (a hostfile in its job directory), its own rendezvous port and its
parameters as variables.  This module holds that config, the start of the
child, the reading of its metrics as its logs grow, and the reading of how it
ended; ``sweeprun.py`` schedules the trials.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.core.config import JobConfig, ViewConfig
from launcher.core.sweep import Trial, Value, parse_metric_json, parse_metric_line, trial_env
from launcher.run.background import start_launcher
from launcher.streams.jobdir import ACTIVE, LAUNCHER_LOG, METRICS, RANK_LOGS, JobDir

SCAN_CHUNK = 1 << 20  # bytes of a trial's logs read per look (the rest on the next one)
MAX_LINE = 64 * 1024  # a longer line is skipped by the metrics reader (never held whole)
PR_SET_PDEATHSIG = 1


def trial_config(
    base: JobConfig,
    root: Path,
    np_per_trial: int,
    trial: Trial,
    job_id: str,
    hostfile: Path,
    port: int,
    metrics: str,
    one_thread: bool = False,
) -> JobConfig:
    """The trial's dtrain job: the sweep's config ``base`` with the trial's command, slots,
    port and variables (with ``one_thread``, OMP_NUM_THREADS=1), its job directory under
    ``root``, and nothing shown (the job directory keeps every line)."""
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
            np=np_per_trial,
            master_port=port,
        ),
        env=replace(base.env, exports=exports),
        view=ViewConfig(quiet=True, color=False, plain=True),
        job_id=job_id,
        job_dir=str(root),
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
        logs = sorted(self.job.path.glob(RANK_LOGS))
        extra = self.job.path / METRICS
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
        if path.name == METRICS:
            self.metrics.update(parse_metric_json(line.decode(errors="replace")))
        elif b"metric:" in line:
            text = line.split(b" ", 2)[-1]  # after "<time> <o|e> "
            self.metrics.update(parse_metric_line(text.decode(errors="replace")))


def launcher_report(job: JobDir) -> tuple[list[str], str | None]:
    """What the trial's launcher said (launcher.log's end): its notes and warnings, and why
    the trial failed, in one line (its error, or the failed rank and its last line)."""
    try:
        with open(job.path / LAUNCHER_LOG, "rb") as f:
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
            job.write_status(status)
    return outcome, code
