"""The jobs under a root: finding one, the running ones, ``dtrain jobs``' summaries (streams)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.base.errors import UsageError
from launcher.streams.jobdir import ACTIVE, DEFAULT_ROOT_SHOWN, META, RUNNING, JobDir, check_root

DEFAULT_ROOT = Path(DEFAULT_ROOT_SHOWN)
ID_TIME_CHARS = len("20261122-035012")  # the part of a job id that is its start time


def jobs_root(option: str | None, environ: Mapping[str, str]) -> Path:
    """``--job-dir``, else ``$DTRAIN_JOB_DIR``, else ``~/.dtrain/jobs``; one that another
    user could write to is refused (``check_root``)."""
    named = "--job-dir" if option else "DTRAIN_JOB_DIR" if environ.get("DTRAIN_JOB_DIR") else ""
    root = Path(option or environ.get("DTRAIN_JOB_DIR") or DEFAULT_ROOT).expanduser()
    check_root(root, named or "the job directory root")
    return root


def list_jobs(root: Path) -> list[JobDir]:
    """Every job under ``root``, oldest first: ids sort by time to the second, and jobs of
    the same second by when their launcher started them."""
    if not root.is_dir():
        return []
    jobs = [JobDir(p) for p in root.iterdir() if (p / META).is_file()]
    return sorted(jobs, key=lambda j: (j.id[:ID_TIME_CHARS], j.started(), j.id))


def running_jobs(root: Path) -> list[JobDir]:
    """The jobs whose launcher runs (or starts), oldest first."""
    return [job for job in list_jobs(root) if job.state() in ACTIVE]


def find_job(root: Path, wanted: str | None) -> JobDir:
    """The job named (or uniquely prefixed) by ``wanted``; the latest when None."""
    jobs = list_jobs(root)
    if not jobs:
        raise UsageError(f"no jobs in {root}", "start one with dtrain run, or pass --job-dir")
    if wanted is None:
        return jobs[-1]
    matches = [j for j in jobs if j.id == wanted] or [j for j in jobs if j.id.startswith(wanted)]
    if len(matches) != 1:
        what = "no job" if not matches else f"{len(matches)} jobs"
        raise UsageError(f"{what} matching {wanted!r} in {root}", "see dtrain jobs")
    return matches[0]


def remove_job(job: JobDir) -> None:
    import shutil  # (not at the top: it loads bz2 and lzma, for every job's start)

    shutil.rmtree(job.path, ignore_errors=True)


@dataclass(frozen=True)
class JobSummary:
    """One line of ``dtrain jobs``."""

    id: str
    state: str
    world_size: str
    hosts: tuple[str, ...]
    size: int
    age_s: float
    command: tuple[str, ...]
    exit_code: int | None = None  # None while it runs, or when its end was not recorded
    duration_s: float | None = None  # from start to its recorded end, or until now


def summarize_jobs(
    root: Path, prune: bool, clock: Callable[[], float] = time.time
) -> tuple[list[JobSummary], int]:
    """Every job under ``root`` (oldest first); with ``prune``, finished ones are removed
    instead (their count is returned)."""
    summaries: list[JobSummary] = []
    removed = 0
    for job in list_jobs(root):
        state = job.state()
        if prune and state not in (RUNNING, "starting"):
            remove_job(job)
            removed += 1
            continue
        meta, status = job.meta(), job.status()
        started = float(status.get("started") or job.path.stat().st_mtime)
        ended = clock() if state in (RUNNING, "starting") else status.get("updated")
        summaries.append(
            JobSummary(
                id=job.id,
                state=state,
                world_size=str(meta.get("world_size", "?")),
                hosts=tuple(meta.get("hosts", [])),
                size=job.size(),
                age_s=clock() - started,
                command=tuple(meta.get("command", [])),
                exit_code=status.get("exit_code"),
                duration_s=None if ended is None else max(0.0, float(ended) - started),
            )
        )
    return summaries, removed
