"""The edge: click options -> plan -> supervisor; errors -> one line and an exit code.

Only this module prints errors and decides exit codes (DESIGN.md rule 5).
Heavy or optional modules are imported inside the commands, so that
``dtrain --help`` stays fast (rule 11).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from launcher.errors import LauncherError, UsageError

if TYPE_CHECKING:
    from launcher.command import LaunchSpec
    from launcher.hosts import Host
    from launcher.plan import Plan

DEFAULT_GRACE_S = 5.0
DEFAULT_MASTER_PORT = 29500  # torchrun's default, shown by dry runs of remote jobs
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="dtrain", prog_name="dtrain")
def cli() -> None:
    """dtrain: launch distributed training jobs on one machine or many.

    \b
      dtrain run -np 4 python train.py
      dtrain run -np 8 -H gpu1:4,gpu2:4 python train.py
      dtrain run --dry-run --json -np 8 --hostfile hosts python train.py
      dtrain hosts --hostfile hosts
    """


def host_options(command: Any) -> Any:
    command = click.option(
        "-H",
        "--host",
        "host_lists",
        multiple=True,
        metavar="HOST[:SLOTS],...",
        help="Hosts and slots, e.g. -H a:4,b:4 or -H a,a,b (repeatable).",
    )(command)
    return click.option(
        "--hostfile",
        metavar="FILE",
        help="Hostfile (Open MPI/DeepSpeed 'host slots=N', Horovod/MPICH 'host:N', one per line).",
    )(command)


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option(
    "-np", "--np", "np_", type=int, metavar="N", help="Number of ranks (default: all slots)."
)
@host_options
@click.option(
    "--map-by",
    type=click.Choice(["slot", "node"]),
    default="slot",
    show_default=True,
    help="slot: fill each host before the next; node: round-robin over hosts.",
)
@click.option("--oversubscribe", is_flag=True, help="Allow more ranks than slots.")
@click.option(
    "--nproc-per-node",
    type=int,
    metavar="K",
    help="Start K ranks on every host (torchrun style), instead of -np.",
)
@click.option("--master-addr", metavar="ADDR", help="Rendezvous address (default: rank 0's host).")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    help="Rendezvous port (default: a free port on rank 0's host).",
)
@click.option(
    "-x",
    "exports",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="Export a variable to every rank; NAME alone copies it from here.",
)
@click.option(
    "--env-file",
    "env_files",
    multiple=True,
    metavar="FILE",
    help="Variables for every rank, dotenv syntax (repeatable).",
)
@click.option("--gpus-per-rank", type=int, metavar="K", help="Bind K GPUs to each rank.")
@click.option("--no-gpu-binding", is_flag=True, help="Leave CUDA_VISIBLE_DEVICES alone.")
@click.option(
    "--tf",
    "tf_config",
    is_flag=True,
    help="Set TF_CONFIG with every rank a worker (MultiWorkerMirroredStrategy).",
)
@click.option("--workdir", metavar="DIR", help="Working directory of the ranks (default: here).")
@click.option(
    "--grace",
    type=click.FloatRange(0),
    default=DEFAULT_GRACE_S,
    show_default=True,
    metavar="SECONDS",
    help="Time between SIGTERM and SIGKILL when stopping ranks.",
)
@click.option(
    "--tag-format",
    default="[{rank}]",
    show_default=True,
    metavar="FORMAT",
    help="Tag of each output line; fields {rank} {host} {local_rank} {node_rank} {role} {time}.",
)
@click.option(
    "--output-dir",
    metavar="DIR",
    help="Also write each rank's output to DIR/rank.N/stdout and stderr.",
)
@click.option("--color/--no-color", default=None, help="Colour rank tags (default: on a terminal).")
@click.option(
    "--dry-run", is_flag=True, help="Print the plan (ranks, commands, environment); start nothing."
)
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(**options: Any) -> int:
    """Run COMMAND as N ranks over the hosts, with torch.distributed variables set."""
    return launch(RunOptions(**options), environ=dict(os.environ))


@cli.command(context_settings=CONTEXT)
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
def hosts(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool) -> int:
    """Show the hosts and slots a hostfile or -H list resolves to."""
    from launcher.console import format_hosts, hosts_as_json

    found = read_hosts(host_lists, hostfile, default_slots=None)
    click.echo(hosts_as_json(found) if as_json else "\n".join(format_hosts(found)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and turn every error into one line and an exit code."""
    try:
        result = cli.main(
            args=list(argv) if argv is not None else None, prog_name="dtrain", standalone_mode=False
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        return 2
    except click.ClickException as exc:
        command = exc.ctx.command_path if getattr(exc, "ctx", None) else "dtrain"  # type: ignore[attr-defined]
        message = exc.format_message().replace("\n", " ")
        click.echo(f"dtrain: error: {message} (hint: see '{command} --help')", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("dtrain: aborted", err=True)
        return 130
    except LauncherError as exc:
        from launcher.console import format_error

        click.echo(format_error(exc), err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return result if isinstance(result, int) else 0


def run_main() -> None:
    """Console-script entry point."""
    sys.exit(main())


def read_text(path: str, what: str) -> str:
    """A user-named file's text; a missing or unreadable file is a usage error."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} {path}: no such file", "check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {path}: cannot read it: {exc}", "check the file") from None


@dataclass(frozen=True)
class RunOptions:
    """``dtrain run``'s command line as one value."""

    command: tuple[str, ...]
    np_: int | None = None
    host_lists: tuple[str, ...] = ()
    hostfile: str | None = None
    map_by: str = "slot"
    oversubscribe: bool = False
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    exports: tuple[str, ...] = ()
    env_files: tuple[str, ...] = ()
    gpus_per_rank: int | None = None
    no_gpu_binding: bool = False
    tf_config: bool = False
    workdir: str | None = None
    grace: float = DEFAULT_GRACE_S
    tag_format: str = "[{rank}]"
    output_dir: str | None = None
    color: bool | None = None
    dry_run: bool = False
    as_json: bool = False


def read_hosts(
    host_lists: Sequence[str], hostfile: str | None, default_slots: int | None
) -> list[Host]:
    """Hosts from -H and --hostfile; localhost with ``default_slots`` when neither is given."""
    from launcher.hosts import Host, parse_host_list, parse_hostfile

    if host_lists and hostfile:
        raise UsageError("both -H and --hostfile given", "use one of them")
    if hostfile:
        return parse_hostfile(read_text(hostfile, "--hostfile"), source=hostfile)
    if host_lists:
        found: list[Host] = []
        for spec in host_lists:
            found.extend(parse_host_list(spec, source="-H"))
        if len(host_lists) > 1:  # repeated -H: re-check the merged list for duplicates
            found = parse_host_list(",".join(host_lists), source="-H")
        return found
    return [Host("localhost", slots=default_slots or 1)]


def launch(options: RunOptions, environ: Mapping[str, str]) -> int:
    """Plan the job, then dry-run it or run it under the supervisor; returns the exit code."""
    from launcher.command import build_launch_specs, describe_specs
    from launcher.console import (
        check_tag_format,
        format_failure,
        format_plan,
        format_plan_json,
        make_line_view,
    )
    from launcher.env import EnvOptions, build_env, build_tf_configs, resolve_env_args
    from launcher.jobs import new_job_id
    from launcher.plan import bind_gpus, plan_ranks
    from launcher.supervisor import Supervisor
    from launcher.transport.local import (
        LocalTransport,
        detect_local_gpus,
        find_free_ports,
        is_local_address,
    )

    if options.as_json and not options.dry_run:
        raise UsageError("--json needs --dry-run", "add --dry-run to print the plan as JSON")
    check_tag_format(options.tag_format)
    local_gpus = None if options.no_gpu_binding else detect_local_gpus(environ)
    default_slots = options.np_ or options.nproc_per_node or len(local_gpus or ()) or 1
    found = read_hosts(options.host_lists, options.hostfile, default_slots)
    plan = plan_ranks(
        found,
        options.np_,
        map_by="node" if options.map_by == "node" else "slot",
        oversubscribe=options.oversubscribe,
        nproc_per_node=options.nproc_per_node,
    )
    local = {h.name: is_local_address(h.name) for h in plan.hosts}
    if local_gpus is not None:
        inventory = {name: local_gpus for name, is_local in local.items() if is_local}
        plan = bind_gpus(plan, inventory, options.gpus_per_rank)
    elif options.gpus_per_rank is not None:
        raise UsageError("--gpus-per-rank and --no-gpu-binding both given", "use one of them")
    all_local = all(local.values())
    extra = resolve_env_args(
        options.exports, [(f, read_text(f, "--env-file")) for f in options.env_files], environ
    )
    ports = iter(find_free_ports(1 + plan.world_size) if all_local else ())
    master_port = options.master_port or next(ports, DEFAULT_MASTER_PORT)
    master_addr = options.master_addr or ("127.0.0.1" if all_local else plan.ranks[0].host.name)
    tf_configs = {}
    if options.tf_config:
        tf_ports = {r.rank: next(ports, DEFAULT_MASTER_PORT + 1 + r.local_rank) for r in plan.ranks}
        addresses = {
            name: "127.0.0.1" for name, is_local in local.items() if is_local and all_local
        }
        tf_configs = build_tf_configs(plan, tf_ports, addresses)
    env_options = EnvOptions(
        job_id=new_job_id(),
        master_addr=master_addr,
        master_port=master_port,
        extra=extra,
        base_env=environ,
        tf_config=tf_configs,
    )
    workdir = options.workdir or os.getcwd()
    specs = build_launch_specs(
        plan, options.command, lambda r: build_env(r, env_options), cwd=workdir
    )
    if options.dry_run:
        entries = describe_specs(specs)
        click.echo(
            format_plan_json(entries) if options.as_json else "\n".join(format_plan(entries))
        )
        return 0
    check_runnable(plan, specs, local, environ)
    view = make_line_view(sys.stdout, sys.stderr, options.tag_format, options.color)
    supervisor = Supervisor(
        specs,
        LocalTransport(environ, grace_s=options.grace),
        view,
        grace_s=options.grace,
        output_dir=Path(options.output_dir) if options.output_dir else None,
    )
    result = supervisor.run()
    for line in format_failure(result):
        click.echo(line, err=True)
    return result.exit_code


def check_runnable(
    plan: Plan, specs: Sequence[LaunchSpec], local: Mapping[str, bool], environ: Mapping[str, str]
) -> None:
    """Refuse, before anything starts, what cannot run: remote hosts, a missing program or dir."""
    remote = [name for name, is_local in local.items() if not is_local]
    if remote:
        raise UsageError(
            f"host {remote[0]} is not this machine: launching on remote hosts over SSH "
            "is not available in this version",
            "run on this machine (localhost), or use --dry-run to see the plan",
        )
    spec = specs[0]
    if spec.cwd is not None and not Path(spec.cwd).is_dir():
        raise UsageError(f"--workdir {spec.cwd}: no such directory", "check the path")
    program = spec.argv[0]
    path = spec.env.get("PATH", environ.get("PATH"))
    if "/" in program:
        target = Path(spec.cwd or ".", program)
        if not target.exists():
            raise UsageError(f"program {program} not found on localhost", "check the path")
    elif shutil.which(program, path=path) is None:
        raise UsageError(
            f"program {program!r} not found on PATH on localhost",
            "check the spelling, install it, or give its full path",
        )
