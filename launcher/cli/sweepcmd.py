"""``dtrain sweep`` (the edge): many trials of one command over the hosts' slots, each a
dtrain job, and the table of their metrics.

The flags become a ``SweepOptions`` and a ``JobConfig``; the job layer plans or
resumes the sweep (``run/sweepstart.py``) and runs it (``run/sweeprun.py``) with
the view's ``SweepView`` as its frontend; this module prints what they return.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from launcher.cli.help import GroupedCommand
from launcher.cli.hostcmds import hosts_given
from launcher.cli.options import JOB_COMMAND, table_options
from launcher.cli.projectfile import with_project_file

if TYPE_CHECKING:
    from launcher.streams.sweeprecord import Sweep


@click.command("sweep", context_settings=JOB_COMMAND, cls=GroupedCommand, manual="docs/sweeps.md")
@table_options("sweep")
@click.argument("command", nargs=-1, required=False, type=click.UNPROCESSED)
def sweep_command(**options: Any) -> int:
    """Run COMMAND once per trial, {name} filled with the trial's parameters, trials side by
    side on the hosts' free slots; a table of their metrics (metric: name=value lines).

    \b
      dtrain sweep --grid 'lr=0.1,0.01 bs=32,64' -H h1:4,h2:4 train.py --lr {lr}
      dtrain sweep --random 9 --param 'lr=loguniform(1e-4,0.1)' train.py --lr {lr}
      dtrain sweep --np-per-trial 2 --grid lr=0.1,0.01 ddp.py --lr {lr}
      dtrain sweep --resume SWEEP          # the trials that did not finish
    """
    from launcher.core.config import pick
    from launcher.core.optionvalues import config_from_options
    from launcher.run import sweepstart
    from launcher.run.sweeprun import SweepRunner
    from launcher.streams.joblist import jobs_root
    from launcher.view.sweepview import (
        SweepView,
        format_nothing_left,
        format_sweep_start,
        format_trials,
    )

    options = with_project_file(options)  # the project file's [sweep] and [defaults]
    environ = dict(os.environ)
    root = jobs_root(options["job_dir"], environ)
    chosen = pick(sweepstart.SweepOptions, options)
    notes: list[str] = []
    if chosen.resume is not None:
        sweepstart.check_resume(chosen)
        given = options["host_lists"] or options["hostfile"]
        hosts = hosts_given(options["host_lists"], options["hostfile"]) if given else None
        sweep = sweepstart.resumed_sweep(chosen.resume, chosen, root, hosts)
        indices = sweepstart.resume_indices(sweep, chosen.retry_failed)
        if not indices:  # every trial finished: the results as they are
            for line in format_nothing_left(sweep.id, sweep.rows(), chosen.retry_failed):
                click.echo(line, err=True)
            print_results(sweep, options["as_json"])
            return 0 if all(row.state == "succeeded" for row in sweep.rows()) else 1
    else:
        plan = sweepstart.plan_sweep(config_from_options(options), chosen, environ)
        notes = sweepstart.sweep_notes(plan.space, plan.base.command, chosen.seed is not None)
        if chosen.dry_run:
            for note in notes:
                click.echo(note, err=True)
            for line in format_trials(plan.trials, options["as_json"]):
                click.echo(line)
            return 0
        sweep = sweepstart.create_sweep(plan, root, environ)
        indices = [t.index for t in sweep.trials]
    live = sys.stderr.isatty() and not options["plain"]
    followed = sys.stderr if options["as_json"] else sys.stdout  # stdout: the JSON alone
    view = SweepView(sweep.id, followed, sys.stderr, live, objective=sweep.settings.objective)
    view.know([row for row in sweep.rows() if row.trial not in indices])
    slots = sum(h.slots for h in sweep.hosts)
    for line in format_sweep_start(sweep.id, len(indices), len(sweep.trials), slots):
        view.notice(line)
    for note in notes:
        view.notice(note)
    code = SweepRunner(sweep, environ, view, chosen.follow).run(indices)
    unreported = sweepstart.objective_note(sweep.settings.objective, sweep.rows())
    if unreported is not None:
        view.notice(unreported)
    print_results(sweep, options["as_json"])
    return code


def print_results(sweep: Sweep, as_json: bool) -> None:
    """The results table (or its JSON) on stdout, the terminal's width when it is one."""
    from launcher.view.sweepview import format_results, results_json

    settings = sweep.settings
    if as_json:
        lines = [results_json(sweep.id, sweep.rows(), settings.objective, settings.maximize)]
    else:
        import shutil

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        lines = format_results(sweep.rows(), settings.objective, settings.maximize, width, sweep.id)
    try:
        click.echo("\n".join(lines))
    except OSError:  # the terminal went away (SIGHUP): the sweep's record has the results
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
