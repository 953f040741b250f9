"""Following a job's log (job layer): ``dtrain logs`` and the job it shows.

``dtrain logs`` reads a job's directory, as it grows with ``-f``, until the job
ends; between the ranks' lines it puts what the launcher said between attempts
(a restart, the attempt that failed).  This module does the reading and the
waiting, and hands what it finds to a frontend the edge gives it (the view's
``LogView``), which prints: the job layer never does.  It also picks the job a
command means when none is named: the latest running one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from launcher.core.command import LaunchSpec
from launcher.streams.jobdir import JobDir
from launcher.streams.joblist import find_job, running_jobs
from launcher.streams.joblogs import LogLine, LogQuery, attempt_events, select_lines


class LogFrontend(Protocol):
    """Where the lines go (the terminal, as the edge gives it)."""

    def show_line(self, line: LogLine) -> None: ...

    def add_notes(self, notes: Iterable[tuple[float, str]]) -> None:
        """The launcher's own lines, as (time, text), to show among the ranks' by time."""
        ...

    def tick(self, now: float) -> None:
        """Nothing came for a while: lines held back (to collapse them) may go out now."""
        ...


def pick_job(root: Path, wanted: str | None, running_first: bool) -> tuple[JobDir, int]:
    """The job named (or uniquely prefixed) by ``wanted``; without one and with
    ``running_first``, the running job (the latest started), else the latest job.  With it,
    how many jobs run (0 when ``wanted`` named one): the edge says which it took."""
    running = running_jobs(root) if running_first and wanted is None else []
    return (running[-1] if running else find_job(root, wanted)), len(running)


def show_log(
    job: JobDir,
    specs: Mapping[int, LaunchSpec],
    query: LogQuery,
    frontend: LogFrontend,
    follow: bool,
    tail: int | None = None,
    notes: bool = True,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """The job's lines that ``query`` selects (with ``tail``: the last N of what is recorded
    now), merged by time, to ``frontend``; with ``follow``, new ones until the job ends.
    With ``notes``, the launcher's lines about restarts go among them."""
    skip = 0
    if tail is not None:  # the backlog's last N lines (then, with follow, what comes)
        skip = max(0, sum(1 for _ in select_lines(job, specs, query, False, clock)) - tail)
    looked = clock()
    if notes:
        frontend.add_notes(attempt_events(job))

    def idle(seconds: float) -> None:  # following: held lines and notes come out on time
        if notes:
            frontend.add_notes(attempt_events(job))
        frontend.tick(clock())
        sleep(seconds)

    lines = select_lines(job, specs, query, follow, clock, sleep=idle)
    for index, line in enumerate(lines):
        if notes and line.time > looked:  # written since we last looked: a restart before it?
            looked = clock()
            frontend.add_notes(attempt_events(job))
        if index >= skip:
            frontend.show_line(line)


def followed_exit_code(job: JobDir) -> int:
    """``dtrain logs -f``'s exit code once the job ended: the job's own (1 when lost)."""
    if job.state() == "lost":
        return 1
    return int(job.status().get("exit_code") or 0)
