"""A job in a launcher process of its own, tied to the process that started it (job layer):
``launcher.start``.

The launcher is ``python -m ENTRY LAUNCH_FILE`` in a session of its own (a Ctrl-C meant
for the caller, or a notebook's "interrupt kernel", does not reach it), with the job's
config in a 0600 file it removes once read (as ``--detach`` does: ``-x`` values never go
on a command line).  Its stdin is a pipe whose other end only the caller holds: when the
caller's process ends, however it ends, the launcher reads EOF and stops the job as
``dtrain stop`` would (``watch_caller``).  The job has a job directory like any other, so
``dtrain jobs``, ``dtrain logs`` and ``dtrain stop`` see it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from launcher.core.config import JobConfig
from launcher.run.background import STOP_EXTRA_S, write_launch_file, write_starting
from launcher.streams.jobdir import LAUNCHER_LOG, STOP_MARK, JobDir, open_private


class AttachedLauncher:
    """The background launcher of one job, as its caller holds it."""

    def __init__(self, config: JobConfig, root: Path, environ: Mapping[str, str], entry: str):
        job_id = config.job_id or ""
        self.job = JobDir.create(root, job_id, {"id": job_id, "command": list(config.command)})
        self.grace_s = config.grace_s
        launch_file = write_launch_file(self.job, config)
        with open_private(self.job.path / LAUNCHER_LOG, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", entry, str(launch_file)],
                stdin=subprocess.PIPE,  # the caller's lifeline: EOF when the caller is gone
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=dict(environ),
            )
        write_starting(self.job, self.process.pid)  # it answers for the job from now on

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it ended (None: still running after ``timeout`` seconds)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Stop the job as ``dtrain stop`` does: marked stopped, SIGTERM to its launcher
        (which tears the ranks down), SIGKILL if it is still there after the grace."""
        if self.process.poll() is not None:
            return
        open_private(self.job.path / STOP_MARK).close()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        if self.wait(self.grace_s + STOP_EXTRA_S) is None:
            self.process.kill()  # the watchdogs end the ranks once their launcher is gone
            self.process.wait()

    def log_text(self) -> str:
        """What the launcher itself wrote (an error before the job could start)."""
        try:
            return (self.job.path / LAUNCHER_LOG).read_text(errors="replace")
        except OSError:
            return ""


def watch_caller(lifeline: int) -> None:
    """In the background launcher: once ``lifeline`` (the fd of stdin, the caller's pipe)
    reads EOF, the caller is gone, and the job stops as on ``dtrain stop`` (SIGTERM to this
    process).  Read unbuffered: a thread blocked in ``sys.stdin`` would hold its lock, and
    the interpreter aborts at exit on it."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(lifeline, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dtrain-caller-watch", daemon=True).start()
