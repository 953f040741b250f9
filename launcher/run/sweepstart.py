"""Starting a sweep (job layer): from the command line's choices to a recorded sweep.

A new sweep is planned (its search space drawn, its trials checked as ``dtrain
run`` checks a job) and then recorded with all its trials pending; a resumed one
(``--resume ID``) is read back from its record, with the hosts and settings the
resume command line gives instead of the recorded ones.  The edge prints what
these return (``--dry-run``'s trials, the notes); ``sweeprun.py`` runs the trials.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.base.errors import UsageError
from launcher.base.jobid import new_job_id
from launcher.core.config import JobConfig, validate_config
from launcher.core.hosts import Host
from launcher.core.sweep import (
    SearchSpace,
    Trial,
    TrialRow,
    build_space,
    check_choices,
    metric_names,
    plan_trials,
    trials_to_rerun,
    unused_params,
    variable_name,
)
from launcher.run.early import job_variables
from launcher.run.namedfiles import check_ssh_files
from launcher.run.survey import hostfile_shorthand, read_hosts
from launcher.run.trial import trial_config
from launcher.streams.jobdir import make_private_dir
from launcher.streams.sweeprecord import (
    SWEEPS,
    Sweep,
    SweepSettings,
    TrialRecord,
    check_fits,
    load_sweep,
)
from launcher.transport.local import detect_local_gpus


@dataclass(frozen=True)
class SweepOptions:
    """``dtrain sweep``'s own options, named as its flags' values (the rest make the config)."""

    grids: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    random_count: int | None = None
    seed: int | None = None
    np_per_trial: int = 1
    max_parallel: int | None = None
    retries: int | None = None
    objective: str | None = None
    maximize: bool | None = None  # None: neither --maximize nor --minimize given
    follow: int | None = None
    resume: str | None = None
    retry_failed: bool = False
    dry_run: bool = False
    command: tuple[str, ...] = ()
    exports: tuple[str, ...] = ()


@dataclass(frozen=True)
class SweepPlan:
    """A new sweep, checked and not yet recorded (what ``--dry-run`` shows)."""

    base: JobConfig
    space: SearchSpace
    settings: SweepSettings
    trials: list[Trial]


# What defines a sweep's trials: recorded, so --resume takes none of it.
SWEEP_DEFINITION = {
    "grids": "--grid",
    "params": "--param",
    "random_count": "--random",
    "seed": "--seed",
    "np_per_trial": "--np-per-trial",
    "dry_run": "--dry-run",
    "command": "COMMAND",
}


def plan_sweep(base: JobConfig, options: SweepOptions, environ: Mapping[str, str]) -> SweepPlan:
    """The sweep the options describe, every option checked (an error before any trial)."""
    if options.retry_failed:
        raise UsageError("--retry-failed is for --resume", "add --resume SWEEP")
    if not options.command:
        raise UsageError(
            "no command given", "write e.g. dtrain sweep --grid 'lr=0.1,0.01' train.py --lr {lr}"
        )
    seed = options.seed if options.seed is not None else choose_seed()
    space = build_space(options.grids, options.params, options.random_count, seed)
    settings = SweepSettings(
        np_per_trial=options.np_per_trial,
        max_parallel=options.max_parallel,
        retries=options.retries or 0,
        objective=options.objective,
        maximize=bool(options.maximize),
    )
    trials, _ = check_sweep(base, space, settings, environ)
    direction = options.maximize is not None
    check_choices(settings.objective, direction, options.follow, len(trials))
    return SweepPlan(base, space, settings, trials)


def check_resume(options: SweepOptions) -> None:
    """``--resume`` takes nothing that defines the trials (before the hosts are read)."""
    given = [
        flag
        for name, flag in SWEEP_DEFINITION.items()
        if getattr(options, name) and (name != "np_per_trial" or options.np_per_trial != 1)
    ]
    if given:
        raise UsageError(
            f"--resume and {given[0]}: a resumed sweep runs its recorded trials",
            "drop it, or start a new sweep without --resume",
        )


def resumed_sweep(
    wanted: str, options: SweepOptions, root: Path, hosts: Sequence[Host] | None
) -> Sweep:
    """``--resume ID``: the recorded sweep ``wanted``; ``hosts`` (-H/--hostfile), -x,
    --max-parallel, --retries and --objective given now replace the recorded ones, the
    trials are as recorded (``check_resume`` said the options define none)."""
    overrides = {
        name: getattr(options, name)
        for name in ("max_parallel", "retries", "objective", "maximize")
        if getattr(options, name) is not None
    }
    sweep = load_sweep(root, wanted, options.exports, hosts, overrides)
    objective, direction = sweep.settings.objective, options.maximize is not None
    check_choices(objective, direction, options.follow, len(sweep.trials))
    return sweep


def sweep_notes(space: SearchSpace, command: Sequence[str], seed_given: bool) -> list[str]:
    """What a new sweep says before it runs: parameters no placeholder uses, a chosen seed."""
    notes = [
        f"dtrain: note: COMMAND has no {{{name}}}: the trials see {name} only as "
        f"${variable_name(name)}"
        for name in unused_params(space, command)
    ]
    if space.params and not seed_given:
        notes.append(f"dtrain: note: drawn with --seed {space.seed} (give it to draw them again)")
    return notes


def objective_note(objective: str | None, rows: Sequence[TrialRow]) -> str | None:
    """After the sweep: a note when no trial reported the metric the table is ordered by."""
    reported = metric_names(rows)
    if not objective or objective in reported:
        return None
    return (
        f"dtrain: note: no trial reported --objective {objective} (metrics: "
        f"{', '.join(reported) or 'none'}); the table is in trial order"
    )


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
    for trial in trials[:1]:  # a trial's options are checked as dtrain run checks them
        config = trial_config(
            base, Path(), settings.np_per_trial, trial, "check", Path("hosts"), 1, "metrics"
        )
        validate_config(config)
        job_variables(config, environ)  # as dtrain run refuses them
        check_ssh_files(config.ssh)
    return trials, hosts


def create_sweep(plan: SweepPlan, root: Path, environ: Mapping[str, str]) -> Sweep:
    """Check everything (again: the hosts may have changed), then record the sweep and its
    trials (all pending)."""
    trials, hosts = check_sweep(plan.base, plan.space, plan.settings, environ)
    sweep_id = new_job_id()
    records = [TrialRecord(t.index, t.params, t.command) for t in trials]
    path = root / SWEEPS / sweep_id
    sweep = Sweep(sweep_id, path, root, plan.base, hosts, plan.settings, plan.space, records)
    try:
        make_private_dir(sweep.path, exist_ok=False)
        sweep.save()
    except OSError as exc:
        raise UsageError(
            f"--job-dir {root}: cannot create the sweep's directory ({exc.strerror})",
            "give a directory you can write to",
        ) from None
    return sweep


def choose_seed() -> int:
    """A seed for --random without --seed (recorded, so the draws can be had again)."""
    return random.SystemRandom().randrange(2**31)


def resume_indices(sweep: Sweep, failed_too: bool) -> list[int]:
    """The trials ``--resume`` runs again: those that did not finish (and failed ones)."""
    return trials_to_rerun({t.index: t.state for t in sweep.trials}, failed_too)
