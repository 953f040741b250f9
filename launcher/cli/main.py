"""The edge: click options -> a frozen ``JobConfig`` -> one call -> its result printed.

This module holds the ``dtrain`` group, ``dtrain run`` and ``dtrain ps`` (the
job commands), the start of a job, and ``main``: the only place that turns
errors into one line and an exit code (DESIGN.md rule 5).  The other commands
live beside it by concern (``jobcmds.py``, ``hostcmds.py``, ``sweepcmd.py``,
``exportcmd.py``) and are added to the group here.  The edge opens no socket,
starts no process and writes no file: the job layer (``run/``) does.  Heavy or
optional modules are imported inside the commands, so that ``dtrain --help``
stays fast (rule 11).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import click

from launcher.base.errors import LauncherError
from launcher.base.interpreter import loading, thaw
from launcher.cli.dialects import peer_options
from launcher.cli.help import GroupedCommand
from launcher.cli.lazygroup import LazyGroup
from launcher.cli.options import COMMAND, CONTEXT, JOB_COMMAND, table_options
from launcher.cli.projectfile import with_project_file
from launcher.core.config import JobConfig, PsConfig, pick
from launcher.core.optionvalues import config_from_options, run_options_config

# The other commands, by concern; each module loads when its command is named (lazygroup.py).
ELSEWHERE = {
    **{name: f"launcher.cli.jobcmds:{name}" for name in ("logs", "jobs", "stop", "stacks", "top")},
    "hosts": "launcher.cli.hostcmds:hosts",
    "check": "launcher.cli.hostcmds:check",
    "sweep": "launcher.cli.sweepcmd:sweep_command",
    "export": "launcher.cli.exportcmd:export_group",
}


@click.group(context_settings=CONTEXT, cls=LazyGroup, lazy=ELSEWHERE)
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


@cli.command(context_settings=JOB_COMMAND, cls=GroupedCommand)
@table_options("run")
@peer_options()
@COMMAND
def run(**options: Any) -> int:
    """Run COMMAND as N ranks over the hosts, with torch.distributed variables set.

    mpirun, torchrun, horovodrun and deepspeed spellings work too (-n, -hostfile,
    --nproc_per_node, --include...): see docs/coming-from.md.

    \b
      dtrain run -np 4 python train.py
      dtrain run -np 8 -H hosts train.py     # a hostfile; train.py runs in Python
      dtrain run -np 8 -H node1:4,node2:4 python train.py
      dtrain run --nproc-per-node 2 --nnodes 2 -H node1,node2 train.py
      dtrain run --mpi -np 4 python mpi_train.py
    """
    return start_job(run_config(options))


def run_config(options: dict[str, Any]) -> JobConfig:
    """``dtrain run``'s parsed options (in its click context), over the project file's, as
    the job's config (``launch()`` makes its config of the same table: api/options.py)."""
    return run_options_config(with_peer_spellings(with_project_file(options)))


def with_peer_spellings(options: dict[str, Any]) -> dict[str, Any]:
    """The values other launchers' spellings gave (``-n 4``), merged into dtrain's options."""
    from launcher.cli.dialects import PEER_VALUES
    from launcher.core.peerflags import merge_peer_values

    ctx = click.get_current_context()
    params = [p for p in ctx.command.params if p.name and p.expose_value]
    defaults = {p.name: p.default for p in params if p.name}
    flags = {p.name: p.opts[0] for p in params if p.name}
    return merge_peer_values(options, ctx.meta.get(PEER_VALUES, {}), defaults, flags)


@cli.command(
    "ps", context_settings=JOB_COMMAND, cls=GroupedCommand, manual="docs/parameter-servers.md"
)
@table_options("ps")
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
    options = with_peer_spellings(with_project_file(options))
    return start_job(config_from_options(options, ps=pick(PsConfig, options)))


def start_job(config: JobConfig, checked: bool = False) -> int:
    """Run the job here (or in the background with --detach) and print how it went;
    ``checked``: the config was validated already (``_resume``'s, by the parent)."""
    try:
        return start_loaded_job(config, checked)
    finally:
        thaw()  # (start_loaded_job's freeze, on every way out: base/interpreter.py)
        from launcher.run.early import close_early_agents

        close_early_agents()


def start_loaded_job(config: JobConfig, checked: bool) -> int:
    """``start_job``, its modules loaded for good (frozen until it returns: base/interpreter)."""
    with loading(freeze=True):
        from launcher.core.config import validate_config
        from launcher.run.early import job_variables, start_agent_early

        environ = dict(os.environ)
        config = config if checked else validate_config(config)  # (once per job)
        extra = None if config.detach else job_variables(config, environ)  # (once, too)
        config = start_agent_early(config, environ, extra or {})
        if config.placement.host_lists:  # (then no agent was started early: nothing runs yet)
            from launcher.run.preflight import check_hosts_not_split

            check_hosts_not_split(config, environ)
        from launcher.run.attempt import DryRun
        from launcher.run.job import run_job
        from launcher.view.frontend import TerminalFrontend
        from launcher.view.reports import format_dry_run, format_failure

    if config.verbose:
        show_what_dtrain_does(sys.stderr)
    if config.detach and not config.dry_run:
        from launcher.run.background import start_detached
        from launcher.streams.joblist import jobs_root

        detached = start_detached(config, jobs_root(config.job_dir, environ), environ)
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
        outcome = run_job(config, environ, frontend, extra=extra, checked=True)
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
        frontend.say(line)  # (a hung-up terminal: the job directory has the summary)
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

    return start_job(take_launch_file(launch_file), checked=True)  # (the parent checked it)


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
        hint = f"see '{command} --help'"
        context: click.Context | None = getattr(exc, "ctx", None)
        meant = subcommand_meant(args) if context is not None and context.command is cli else None
        if meant is not None:
            message, hint = meant
        click.echo(f"dtrain: error: {message} (hint: {hint})", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("dtrain: aborted", err=True)
        return 130
    except LauncherError as exc:
        from launcher.view.reports import format_error

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


def subcommand_meant(args: Sequence[str]) -> tuple[str, str] | None:
    """``dtrain -np 2 python x.py`` (mpirun's habit) or ``dtrain train.py``: no subcommand,
    where ``dtrain run`` (or ``dtrain ps``) was meant.  The error and the whole line meant
    (None: no such guess).  Only asked once the line failed, and only where every word
    before the program (or the subcommand named later) is an option of the command meant:
    a subcommand's name among the program's arguments never changes the line's meaning."""
    import shlex

    if not args or args[0] in cli.names():
        return None
    first = args[0]
    if first.startswith("-"):
        name = first.split("=", 1)[0]
        commands = [c for c in cli.commands.values() if not c.hidden]
        for command in commands:  # options, then the subcommand: they go after it
            at = first_operand(args, command)
            if at is not None and at < len(args) and args[at] == command.name:
                meant = shlex.join(["dtrain", command.name, *args[:at], *args[at + 1 :]])
                return f"{name} is an option of dtrain {command.name}", f"did you mean: {meant}"
        for command in (run, ps_command):  # options, then the program
            at = first_operand(args, command)
            if at is not None and (at == len(args) or args[at] not in cli.names()):
                meant = shlex.join(["dtrain", str(command.name), *args])
                return f"{name} is an option of dtrain {command.name}", f"did you mean: {meant}"
        return None
    if not looks_like_program(first):
        return None
    meant = shlex.join(["dtrain", "run", *args])
    return f"{first!r} is not a command of dtrain", f"did you mean: {meant}"


def first_operand(args: Sequence[str], command: click.Command) -> int | None:
    """The index of the first word of ``args`` that is neither an option of ``command`` nor
    an option's value (``len(args)``: none); None where a word is an option that
    ``command`` does not have."""
    values: dict[str, int] = {}  # option spelling -> how many words follow it
    for param in command.params:
        if isinstance(param, click.Option):
            takes = 0 if param.is_flag or param.count else param.nargs
            values.update({o: takes for o in param.opts})
            values.update({o: 0 for o in param.secondary_opts})
    at = 0
    while at < len(args):
        word = args[at]
        if not word.startswith("-") or word in ("-", "--"):
            return at
        name, equals, _ = word.partition("=")
        if name not in values:
            return None
        at += 1 if equals else 1 + values[name]
    return at


def looks_like_program(word: str) -> bool:
    """A Python script or interpreter, or a file here: what only ``dtrain run`` takes."""
    from launcher.run.preflight import is_python_interpreter

    return word.endswith(".py") or is_python_interpreter(word) or os.path.isfile(word)


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
        except (OSError, ValueError):  # `dtrain ... | head`, a hung-up terminal: nobody reads
            pass
    os._exit(code)
