"""The commands about jobs (the edge): ``dtrain logs``, ``jobs``, ``stop``, ``stacks``, ``top``.

Each reads a job directory (or asks a running job's launcher through its
control socket) and prints; the following of a growing log is the job layer's
(``run/follow.py``), the tables and views are the view's.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from launcher.cli.options import CONTEXT, JOB_DIR_OPTION, seconds

if TYPE_CHECKING:
    from launcher.streams.jobdir import JobDir


@click.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option("-f", "--follow", is_flag=True, help="Follow a running job until it ends.")
@click.option("--rank", "ranks", metavar="LIST", help="Only these ranks, e.g. 0,3.")
@click.option("--role", metavar="ROLE", help="Only ranks of this role (worker, ps, chief...).")
@click.option("--since", metavar="DURATION", help="Only lines of the last 30s, 10m, 2h, 1d.")
@click.option("--grep", "pattern", metavar="REGEX", help="Only lines matching REGEX.")
@click.option(
    "--attempt",
    type=click.IntRange(0),
    metavar="K",
    help="Only attempt K of a job that restarted (0: the first).",
)
@click.option(
    "-n",
    "--tail",
    type=click.IntRange(0),
    metavar="N",
    help="Only the last N lines (as recorded: with --collapse, collapsed after the cut).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--collapse", is_flag=True, help="Identical lines of several ranks once, tagged [0-7]."
)
@click.option(
    "--collapse-window",
    type=seconds("--collapse-window", 0.01, 60),
    default=0.5,
    show_default=True,
    metavar="SECONDS",
    help="With --collapse: how far apart the same line may come from different ranks.",
)
@JOB_DIR_OPTION
def logs(
    job: str | None,
    follow: bool,
    ranks: str | None,
    role: str | None,
    since: str | None,
    pattern: str | None,
    attempt: int | None,
    tail: int | None,
    as_json: bool,
    collapse: bool,
    collapse_window: float,
    job_dir: str | None,
) -> int:
    """Show a job's logs (default: the latest job; with -f the running one), merged by time,
    tagged by rank, then how the job ended."""
    from launcher.core.config import parse_ranks
    from launcher.streams.follow import followed_exit_code, pick_job, show_log
    from launcher.streams.joblist import jobs_root
    from launcher.streams.joblogs import LogQuery, parse_duration
    from launcher.streams.recorder import recorded_result
    from launcher.view.logview import LogView
    from launcher.view.reports import format_ending

    query = LogQuery(
        ranks=parse_ranks(ranks) if ranks is not None else None,
        role=role,
        since_s=parse_duration(since) if since else None,
        pattern=pattern,
        attempt=attempt,
    )
    found, running = pick_job(jobs_root(job_dir, os.environ), job, running_first=follow)
    if running:  # -f without a job: the running one (the latest started), said so
        several = f" (the latest of {running} running)" if running > 1 else ""
        click.echo(f"dtrain: following job {found.id}{several}", err=True)
    view = LogView(
        found.recorded_specs(), sys.stdout, as_json, collapse_window if collapse else None
    )
    notes = not as_json and attempt is None  # the launcher's lines about restarts
    show_log(found, view.specs, query, view, follow, tail, notes)
    view.finish()
    if not as_json:
        for text in format_ending(found.id, found.state(), recorded_result(found)):
            click.echo(text, err=True)
    return followed_exit_code(found) if follow else 0


@click.command(context_settings=CONTEXT)
@click.option("--prune", is_flag=True, help="Remove the directories of finished jobs.")
@click.option("--running", is_flag=True, help="Only the jobs that run now.")
@click.option("-n", "last", type=click.IntRange(1), metavar="N", help="Only the last N jobs.")
@JOB_DIR_OPTION
def jobs(prune: bool, running: bool, last: int | None, job_dir: str | None) -> int:
    """List jobs with their state, exit code, duration, size and age."""
    from launcher.streams.joblist import jobs_root, summarize_jobs
    from launcher.view.tables import format_jobs

    root = jobs_root(job_dir, os.environ)
    summaries, removed = summarize_jobs(root, prune)
    if running:
        summaries = [s for s in summaries if s.state in ("running", "starting")]
    if last is not None:
        summaries = summaries[-last:]
    if prune:
        click.echo(f"dtrain: removed {removed} finished job(s) from {root}", err=True)
    import shutil

    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    for line in format_jobs(summaries, width):
        click.echo(line)
    return 0


@click.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@JOB_DIR_OPTION
def stop(job: str | None, job_dir: str | None) -> int:
    """Stop a running job on every host (its ranks get SIGTERM, then SIGKILL).

    Without JOB: the only running job.
    """
    from launcher.run.background import stop_job
    from launcher.streams.joblist import jobs_root

    click.echo(stop_job(jobs_root(job_dir, os.environ), job), err=True)
    return 0


@click.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="Every rank's py-spy dump as JSON.")
@JOB_DIR_OPTION
def stacks(job: str | None, as_json: bool, job_dir: str | None) -> int:
    """Print the Python stack of every rank of a running job, on every host, grouped: identical
    stacks once with their ranks, the ranks that differ marked (py-spy takes them).

    Without JOB: the running job (the latest started if several).
    """
    import json

    from launcher.core.stacks import format_stacks, group_stacks
    from launcher.streams.control import ask

    found = running_job(job, job_dir)
    reply = ask(found.path, {"op": "stacks"}, timeout_s=60)
    dumps = {int(rank): (host, dump) for rank, (host, dump) in reply["stacks"].items()}
    if as_json:
        click.echo(json.dumps({str(r): {"host": h, **d} for r, (h, d) in sorted(dumps.items())}))
        return 0
    world = int(found.meta().get("world_size", len(dumps)))
    click.echo(f"dtrain: stacks of job {found.id} ({len(dumps)} running of {world} ranks)")
    for line in format_stacks(group_stacks(dumps), world):
        click.echo(line)
    return 0 if dumps and all("threads" in d for _, d in dumps.values()) else 1


@click.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option(
    "--once", is_flag=True, help="One table (two samples half a second apart), then exit."
)
@click.option("--json", "as_json", is_flag=True, help="With --once: the rows as JSON.")
@JOB_DIR_OPTION
def top(job: str | None, once: bool, as_json: bool, job_dir: str | None) -> int:
    """A running job's ranks, live: host, pid, state, CPU %, memory, GPU memory, how long each
    has been quiet and its last line (refreshed every second; Ctrl-C to leave).

    Without JOB: the running job (the latest started if several).
    """
    import json
    import time

    from launcher.streams.control import ask
    from launcher.view.topview import format_top, rows_between, watch_top

    found = running_job(job, job_dir)

    def sample() -> dict[int, dict[str, Any]]:
        reply = ask(found.path, {"op": "stats"}, timeout_s=30)
        return {int(rank): row for rank, row in reply["ranks"].items()}

    before = sample()
    if not once:
        if watch_top(found.id, before, sample):
            click.echo(f"dtrain: job {found.id} has ended ({found.state()})", err=True)
        return 0
    time.sleep(0.5)
    rows = rows_between(before, sample())
    click.echo(json.dumps(rows) if as_json else "\n".join(format_top(found.id, rows)))
    return 0


def running_job(job: str | None, job_dir: str | None) -> JobDir:
    """JOB, or the running one (the latest started if several, said so)."""
    from launcher.streams.follow import pick_job
    from launcher.streams.joblist import jobs_root

    found, running = pick_job(jobs_root(job_dir, os.environ), job, running_first=True)
    if running > 1:
        click.echo(f"dtrain: job {found.id} (the latest of {running} running)", err=True)
    return found
