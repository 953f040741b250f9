"""Jobs in the background (job layer): ``--detach`` starts a launcher of its own, ``dtrain stop``
ends one.

The background launcher is ``python -m launcher _resume CONFIG_JSON`` in a
session of its own; it records its pid in the job directory, where
``dtrain stop`` finds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.base.errors import UsageError
from launcher.base.jobid import new_job_id
from launcher.core.config import JobConfig, config_from_json, config_to_json
from launcher.core.options import DEFAULT_GRACE_S
from launcher.streams.jobdir import (
    ACTIVE,
    LAUNCH_FILE,
    LAUNCHER_LOG,
    STOP_MARK,
    JobDir,
    open_private,
    process_start,
    write_json,
)
from launcher.streams.joblist import find_job, running_jobs

DETACH_WAIT_S = 60.0  # how long --detach waits for the job to start (or fail) before returning
STOP_EXTRA_S = 15.0  # beyond the grace period, how long dtrain stop waits for the launcher
POLL_S = 0.05


@dataclass(frozen=True)
class Detached:
    """What ``--detach`` did: the job id, or the background launcher's error and exit code."""

    job_id: str
    exit_code: int = 0
    error: str | None = None


def start_launcher(
    config: JobConfig,
    job: JobDir,
    environ: Mapping[str, str],
    preexec: Callable[[], None] | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m launcher _resume`` for the job, in a session of its own, its output to
    ``launcher.log``.  The config (with -x values) goes through a 0600 file, never the
    command line (ps); this process speaks for the job until the launcher does."""
    payload = write_launch_file(job, config)
    write_starting(job, os.getpid())
    with open_private(job.path / LAUNCHER_LOG, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "launcher", "_resume", str(payload)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=dict(environ),
            preexec_fn=preexec,
        )


def start_detached(config: JobConfig, root: Path, environ: Mapping[str, str]) -> Detached:
    """Start the launcher in its own session; return once the job runs (or failed to start)."""
    job_id = new_job_id()
    job = JobDir.create(root, job_id, {"id": job_id, "command": list(config.command)})
    view = replace(config.view, quiet=True, color=False)
    child = replace(config, detach=False, job_id=job_id, view=view)
    process = start_launcher(child, job, environ)
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        ended = process.poll() is not None  # before the status: a status read after it is fresh
        status = job.status()
        if ended and status.get("state") in ("starting", "running"):
            # It ended before it could start the job: its error is ours.
            lines = (job.path / LAUNCHER_LOG).read_text(errors="replace").splitlines()
            error = next(
                (ln for ln in reversed(lines) if ln.startswith("dtrain:")),
                "dtrain: error: the background launcher failed",
            )
            return Detached(job_id, process.returncode or 1, error)
        if status.get("ranks") or status.get("state") not in ("starting", "running"):
            break
        time.sleep(POLL_S)
    return Detached(job_id)


def write_launch_file(job: JobDir, config: JobConfig) -> Path:
    """The config a background launcher reads (and removes): a 0600 file, never its argv."""
    write_json(job.path / LAUNCH_FILE, config_to_json(config))
    return job.path / LAUNCH_FILE


def write_starting(job: JobDir, pid: int) -> None:
    """The job is starting, and ``pid`` answers for it (not "lost" while it starts)."""
    job.write_status(
        {
            "id": job.id,
            "state": "starting",
            "launcher_pid": pid,
            "launcher_start": process_start(pid),
            "launcher_host": socket.gethostname(),
            "ranks": {},
        }
    )


def only_running_job(root: Path) -> JobDir:
    running = running_jobs(root)
    if not running:
        raise UsageError(f"no job is running in {root}", "see dtrain jobs")
    if len(running) > 1:
        raise UsageError(
            f"{len(running)} jobs are running: {', '.join(j.id for j in running)}",
            "name the one to stop: dtrain stop JOB",
        )
    return running[0]


def take_launch_file(path: str) -> JobConfig:
    """The background launcher's config: read once, then removed (it may hold -x values)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"_resume {path}: cannot read the job's config ({exc})") from None
    finally:
        Path(path).unlink(missing_ok=True)
    write_starting(JobDir(Path(path).parent), os.getpid())
    return config_from_json(data)


def stop_job(root: Path, wanted: str | None) -> str:
    """Stop a running job (its launcher tears it down); returns what happened, in words.
    With no job named: the only running one."""
    found = find_job(root, wanted) if wanted is not None else only_running_job(root)
    status = found.status()
    state = found.state()  # "lost" when the recorded pid now names another process
    if state not in ACTIVE:  # running, starting, or between two attempts (restarting)
        raise UsageError(f"job {found.id} is not running ({state})", "see dtrain jobs")
    pid = int(status.get("launcher_pid", 0))
    host = status.get("launcher_host")
    if host and host != socket.gethostname():
        raise UsageError(
            f"job {found.id} runs from {host}, not this machine", f"run dtrain stop on {host}"
        )
    open_private(found.path / STOP_MARK).close()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"dtrain: job {found.id} had already ended"
    grace = float(found.meta().get("grace_s", DEFAULT_GRACE_S))
    deadline = time.monotonic() + grace + STOP_EXTRA_S
    while JobDir.launcher_alive(status) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if JobDir.launcher_alive(status):  # the watchdogs end the ranks once their launcher is gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return f"dtrain: stopped job {found.id}"
