"""``start(fn, ...)``: the job in a launcher of its own, and a ``Job`` handle to it.

The call is checked and packed here, as ``launch`` does it (a bad option raises before
anything starts); the job then runs in a background launcher process
(``run/attached.py``, ``api/child.py``), through the same ``run_job``, so the caller's
signals, threads and streams are not the job's.  When the caller's process ends, so does
the job (its launcher stops it, as ``dtrain stop`` would).
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from launcher.api.errors import JobFailed
from launcher.api.launching import Prepared, Result, collect, prepare
from launcher.api.typedoptions import Options
from launcher.base.errors import UsageError
from launcher.run.attached import AttachedLauncher
from launcher.streams.joblist import jobs_root

if TYPE_CHECKING:  # (launch()'s keywords typed; typing has Unpack from Python 3.11)
    from typing_extensions import Unpack
elif sys.version_info >= (3, 11):
    from typing import Unpack

CHILD = "launcher.api.child"
STARTING_POLL_S = 0.05  # logs(follow=True): how often to look whether the ranks started
HELD: list[AttachedLauncher] = []  # the running jobs' launchers: their lifelines stay open


class Job:
    """A job that ``start`` started: its id, ``status``, ``wait``, ``result``, ``logs``,
    ``stop``.  ``dtrain jobs``, ``dtrain logs`` and ``dtrain stop`` see it too."""

    def __init__(self, prepared: Prepared, launcher: AttachedLauncher) -> None:
        self.prepared = prepared
        self.launcher = launcher
        self.job_id = prepared.job_id
        self.job_dir = str(launcher.job.path)

    def __repr__(self) -> str:
        return f"<launcher.Job {self.job_id} {self.status}>"

    @property
    def status(self) -> str:
        """starting, running, restarting, succeeded, failed, stopped, interrupted or lost."""
        return self.launcher.job.state()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the job's end: its exit code (None: still running after ``timeout`` s)."""
        code = self.launcher.wait(timeout)
        if code is not None and self.launcher in HELD:
            HELD.remove(self.launcher)
        return code

    def result(self, timeout: float | None = None) -> Result:
        """Every rank's return value once the job ended; ``RankFailed``/``JobFailed`` as
        ``launch`` raises them; ``TimeoutError`` if it still runs after ``timeout`` s."""
        from launcher.streams.recorder import recorded_result

        code = self.wait(timeout)
        if code is None:
            raise TimeoutError(f"job {self.job_id} still runs after {timeout:g} s")
        recorded = recorded_result(self.launcher.job)
        if recorded is None:  # its launcher ended before the job started: why
            raise self.start_error(code)
        return collect(self.prepared, recorded, sys.stderr)

    def start_error(self, code: int) -> JobFailed:
        said = [ln for ln in self.launcher.log_text().splitlines() if ln.startswith("dtrain:")]
        text = said[-1] if said else f"the job's launcher exited with {code} before it started"
        return JobFailed(
            text.removeprefix("dtrain: ").removeprefix("error: "),
            job_id=self.job_id,
            exit_code=code,
            state=self.status,
        )

    def logs(self, follow: bool = False) -> str | None:
        """The job's lines so far, tagged as ``dtrain logs`` shows them; with ``follow``,
        printed to stdout as they come until the job ends (returns None)."""
        from launcher.streams.follow import show_log
        from launcher.streams.joblogs import LogQuery
        from launcher.view.logview import LogView

        while follow and self.status == "starting":  # (its ranks are known once it runs)
            time.sleep(STARTING_POLL_S)
        text = io.StringIO()
        view = LogView(self.launcher.job.recorded_specs(), sys.stdout if follow else text)
        show_log(self.launcher.job, view.specs, LogQuery(), view, follow)
        view.finish()
        return None if follow else text.getvalue()

    def stop(self) -> None:
        """Stop the job as ``dtrain stop`` does (SIGTERM, the grace, SIGKILL); waits."""
        self.launcher.stop()
        self.wait()


def start(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    np: int | None = None,
    hosts: str | Sequence[str] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    **options: Unpack[Options],
) -> Job:
    """Start ``fn(*args, **kwargs)`` on every rank, as ``launch`` does, and return at once
    with a ``Job``; the job's lines go to its job directory only (``job.logs()``)."""
    if options.get("dry_run"):
        raise UsageError("start() runs the job", "for a dry run: launch(fn, ..., dry_run=True)")
    given = {"np": np, "hosts": hosts, "hostfile": hostfile, **options}
    prepared = prepare(fn, args, kwargs, given)
    config = prepared.config
    config = replace(config, view=replace(config.view, quiet=True, color=False))
    root = jobs_root(config.job_dir, prepared.environ)
    launcher = AttachedLauncher(config, root, prepared.environ, CHILD)
    HELD[:] = [held for held in HELD if held.process.poll() is None]
    HELD.append(launcher)
    return Job(prepared, launcher)
