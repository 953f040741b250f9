"""The edge's option declarations: the flags the job commands share, each named as the
config field it sets.

The command modules (``main.py``, ``sweepcmd.py``, ``exportcmd.py``) apply these
to their commands; ``optionvalues.config_from_options`` turns the parsed values into
a ``JobConfig`` by those names, so a flag's journey starts here: ``-x exports``
fills ``EnvConfig.exports``.  ``help.py`` says under which heading each shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import click

from launcher.core.bounds import MAX_SECONDS
from launcher.core.config import (
    DEFAULT_GRACE_S,
    DEFAULT_HOST_TIMEOUT_S,
    DEFAULT_SSH_TIMEOUT_S,
    DEFAULT_STRAGGLER_AFTER_S,
    DEFAULT_STRAGGLER_RATIO,
)

F = TypeVar("F", bound=Callable[..., Any])


class Decorator(Protocol):
    def __call__(self, command: F, /) -> F: ...


def option(declarations: str, help: str, **settings: Any) -> Decorator:
    """``click.option`` with its flags (and the config field it sets) in one string."""
    return click.option(*declarations.split(), help=help, **settings)


def stacked(*decorators: Decorator) -> Decorator:
    """One decorator applying several, in the order given (the first is listed first)."""

    def apply(command: F) -> F:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


class Seconds(click.FloatRange):
    """Every duration option's type: a finite number of seconds from ``low`` to ``high`` (a year
    unless less is given).  click's FloatRange lets nan through (no comparison is true of it)
    and inf too when there is no maximum: a nan --grace never escalates to SIGKILL, an inf
    one overflows the teardown's waits."""

    def __init__(self, low: float, high: float = MAX_SECONDS) -> None:
        # (no maximum for click when it is the year: --help keeps saying 'x>=0.1')
        super().__init__(low, None if high == MAX_SECONDS else high)
        self.high = high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value} is not a finite number of seconds", param, ctx)
        if seconds > self.high:  # (a lower maximum is click's to check)
            self.fail(f"{value} is more than a year ({self.high:,.0f} seconds)", param, ctx)
        return seconds


class Share(click.FloatRange):
    """--straggler-ratio: a share, more than 0 and less than 1 (nan refused: click's range
    lets it through, and no rate is ever below a nan share)."""

    def __init__(self) -> None:
        super().__init__(0, 1, min_open=True, max_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        share = super().convert(value, param, ctx)
        if not math.isfinite(share):
            self.fail(f"{value} is not a number between 0 and 1", param, ctx)
        return share


class ByteSize(click.ParamType):  # type: ignore[type-arg]  # (generic from click 8.2)
    """--sync-max-size: bytes, or a number with K, M, G or T (500M, 2G, 1.5GiB)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int):
            return value
        from launcher.base.errors import UsageError
        from launcher.core.synctree import parse_size

        try:
            return parse_size(str(value))
        except UsageError:
            self.fail(f"{value!r} is not a size (write bytes, or 500M, 2G)", param, ctx)


CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
# A job command's options end at COMMAND: what follows is the command's own.
JOB_COMMAND: dict[str, Any] = {**CONTEXT, "allow_interspersed_args": False}
COMMAND = click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
JOB_DIR_OPTION = option(
    "--job-dir", "Where job directories live (default ~/.dtrain/jobs).", metavar="DIR"
)
# The project file (dtrain.toml or pyproject.toml's [tool.dtrain], cli/projectfile.py): the
# one named, or none; every command that reads the file has both.
NO_CONFIG_OPTION = stacked(
    option(
        "--config project_file",
        "Read this project file (a dtrain.toml, or a pyproject.toml's [tool.dtrain]) instead "
        "of looking here and above.",
        metavar="FILE",
    ),
    option(
        "--no-config",
        "Ignore the project file (dtrain.toml, or [tool.dtrain] in pyproject.toml, here or above).",
        is_flag=True,
    ),
)

SECONDS = {"metavar": "SECONDS", "show_default": True}
COUNT = {"metavar": "N", "show_default": True}
host_options = stacked(
    option(
        "-H --host host_lists",
        "Hosts and slots, e.g. -H a:4,b:4, -H a,a,b or -H a:* (its GPUs, else CPUs; repeatable).",
        multiple=True,
        metavar="HOST[:SLOTS],...",
    ),
    option(
        "--hostfile",
        "Hostfile (Open MPI/DeepSpeed 'host slots=N', Horovod/MPICH 'host:N', one per line).",
        metavar="FILE",
    ),
)
# The ssh flags a user would give ssh itself; ~/.ssh/config supplies the rest.
ssh_options = stacked(
    option("--ssh-config config_file", "ssh config file (default ~/.ssh/config).", metavar="FILE"),
    option(
        "--ssh-port port",
        "SSH port for every host (overrides the config).",
        type=click.IntRange(1, 65535),
        metavar="PORT",
    ),
    option("--ssh-identity identity", "Private key to log in with.", metavar="KEY"),
    option(
        "--ssh-timeout timeout_s",
        "Connect timeout per host.",
        type=Seconds(0.1),
        default=DEFAULT_SSH_TIMEOUT_S,
        **SECONDS,
    ),
    option(
        "--host-timeout host_timeout_s",
        "A host whose agent is silent this long (it beats every 5 s at most) is lost.",
        type=Seconds(1),
        default=DEFAULT_HOST_TIMEOUT_S,
        **SECONDS,
    ),
    option(
        "--accept-new-host-keys",
        "Trust hosts not yet in known_hosts and record their keys.",
        is_flag=True,
    ),
)
# What every rank of a job gets: rendezvous, variables, GPUs, directory, the grace period.
rank_options = stacked(
    option(
        "--master-port",
        "Rendezvous port (default: a free port on rank 0's host).",
        type=click.IntRange(1, 65535),
        metavar="PORT",
    ),
    option(
        "-x exports",
        "Export a variable to every rank; NAME alone copies it from here, a PATTERN "
        "('WANDB_*') every variable here it matches.",
        multiple=True,
        metavar="NAME[=VALUE]",
    ),
    option(
        "--env-file env_files",
        "Variables for every rank, dotenv syntax (repeatable).",
        multiple=True,
        metavar="FILE",
    ),
    option("--gpus-per-rank", "Bind K GPUs to each rank.", type=int, metavar="K"),
    option(
        "--no-gpu-binding gpu_binding",
        "Leave CUDA_VISIBLE_DEVICES alone.",
        flag_value=False,
        default=True,
    ),
    option("--workdir", "Working directory of the ranks (default: here).", metavar="DIR"),
    option(
        "--sync",
        "Copy DIR (its files git would keep) to every remote host first; the ranks there run "
        "in the copy.",
        metavar="DIR",
    ),
    option(
        "--sync-max-size",
        "Refuse a --sync tree bigger than this.",
        type=ByteSize(),
        default="1G",
        show_default=True,
        metavar="SIZE",
    ),
    option(
        "--python",
        "Interpreter for a Python script COMMAND (train.py runs as PYTHON train.py). Default: "
        "dtrain's own; on other hosts the same path if it exists there, else python3.",
        metavar="PATH",
    ),
    option(
        "--no-python", "Run COMMAND as given, even train.py (as torchrun's flag).", is_flag=True
    ),
    option("-m --module", "COMMAND is a Python module: run python -m COMMAND.", is_flag=True),
    option(
        "--network-interface nics",
        "NIC for gloo, NCCL and TensorPipe on every host (default: the one towards rank 0).",
        metavar="IFACE",
    ),
    option(
        "--grace grace_s",
        "Time between SIGTERM and SIGKILL when stopping ranks.",
        type=Seconds(0),
        default=DEFAULT_GRACE_S,
        **SECONDS,
    ),
)
# What the terminal shows, and where the job runs from.
view_options = stacked(
    option(
        "--tag-format",
        "Tag of each output line; fields {rank} {host} {local_rank} {node_rank} {role} {time}.",
        metavar="FORMAT",
    ),
    option(
        "--output-dir",
        "Also write each rank's output to DIR/rank.N/stdout and stderr.",
        metavar="DIR",
    ),
    option("--color/--no-color", "Colour rank tags (default: on a terminal).", default=None),
    option(
        "--dry-run", "Print the plan (ranks, commands, environment); start nothing.", is_flag=True
    ),
    option(
        "--json as_json",
        "Output as JSON lines (time, host, rank, role, stream, text); with --dry-run the plan.",
        is_flag=True,
    ),
    JOB_DIR_OPTION,
    NO_CONFIG_OPTION,
    option("--detach", "Run in the background; follow with dtrain logs -f.", is_flag=True),
    option("--plain", "Plain tagged lines, no live status view.", is_flag=True),
    option("--ranks", "Show only these ranks (e.g. 0,3); all are logged.", metavar="LIST"),
    option(
        "--local-ranks",
        "Show only these local ranks of every host (e.g. 0); all are logged.",
        metavar="LIST",
    ),
    option("--quiet", "Show only the summary; all is logged.", is_flag=True),
    option(
        "--collapse/--no-collapse",
        "Show identical lines of several ranks once, tagged [0-7] (default: on a terminal).",
        default=None,
    ),
    option(
        "--collapse-window collapse_window_s",
        "How long a line waits for the same line from other ranks (one that some ranks "
        "said waits up to 2 s more for the rest).",
        type=Seconds(0.01, 60),
        default=0.5,
        **SECONDS,
    ),
    option(
        "-v --verbose",
        "Say what dtrain does (connections, agents, plan, signals), with timestamps.",
        is_flag=True,
    ),
    option(
        "--lossy-view lossy",
        "When the terminal falls behind, drop lines from it (counted) instead of slowing the "
        "ranks; the job directory keeps every line.",
        is_flag=True,
    ),
)
# Fault tolerance: the whole job again after a failure, resuming from its checkpoints.
restart_options = stacked(
    option(
        "--max-restarts",
        "After a failure, start the whole job again, at most N times (new rendezvous port; "
        "ranks see DTRAIN_RESTART_COUNT).",
        type=click.IntRange(0),
        default=0,
        **COUNT,
    ),
    option(
        "--restart-delay restart_delay_s",
        "Wait between attempts (default: 1 s, doubling up to 30 s).",
        type=Seconds(0),
        metavar="SECONDS",
    ),
    option(
        "--min-np",
        "A restart may run fewer ranks (down to N) on the hosts left after failures.",
        type=click.IntRange(1),
        metavar="N",
    ),
    option(
        "--max-np",
        "...and grows back up to N ranks when hosts return (default: -np).",
        type=click.IntRange(1),
        metavar="N",
    ),
    option(
        "--host-discovery-script",
        "It prints the hosts, one host[:slots] per line; run before every attempt and every "
        "3 s: when they change, the job starts again on them (not counted as a restart).",
        metavar="SCRIPT",
    ),
    option(
        "--blacklist-cooldown blacklist_cooldown_s",
        "A failed host may come back after this long, even when the discovery script lists it "
        "again (default: never, in this job).",
        type=Seconds(0),
        metavar="SECONDS",
    ),
    option(
        "--checkpoint-dir",
        "DTRAIN_CHECKPOINT_DIR of every rank (default: checkpoints/ in the job directory).",
        metavar="DIR",
    ),
)
# Time limits: a hang (no output), a slow start, the whole job.
limit_options = stacked(
    option(
        "--hang-timeout hang_timeout_s",
        "No output from any rank for this long: take every rank's stack (job directory and "
        "terminal), then fail with 124 (see --on-hang).",
        type=Seconds(0.1),
        metavar="SECONDS",
    ),
    option(
        "--on-hang",
        "fail: stop the job (exit 124); dump: only show the stacks and go on.",
        type=click.Choice(["fail", "dump"]),
        default="fail",
        show_default=True,
    ),
    option(
        "--start-timeout start_timeout_s",
        "Every rank must have started within this long (else exit 124, naming the late ones).",
        type=Seconds(0.1),
        metavar="SECONDS",
    ),
    option(
        "--timeout time_limit_s",
        "Stop the job after this long (exit 124).",
        type=Seconds(0.1),
        metavar="SECONDS",
    ),
)
# Progress: each rank's step rate from its lines (dtrain top), and the slow ranks named.
progress_options = stacked(
    option(
        "--progress-regex",
        "What a step looks like in the ranks' lines: its group (or group named step) holds "
        "the step (default: tqdm bars and 'metric: step=N' lines).",
        metavar="REGEX",
    ),
    option(
        "--straggler-ratio",
        "Name a rank whose step rate stays below this share of the median rate...",
        type=Share(),
        default=DEFAULT_STRAGGLER_RATIO,
        show_default=True,
        metavar="SHARE",
    ),
    option(
        "--straggler-after straggler_after_s",
        "...for this long (once, on the terminal and in the job directory).",
        type=Seconds(0.1),
        default=DEFAULT_STRAGGLER_AFTER_S,
        **SECONDS,
    ),
    option(
        "--no-stragglers stragglers",
        "Name no straggler (dtrain top still shows each rank's rate).",
        flag_value=False,
        default=True,
    ),
)
transport_option = option(
    "--transport",
    "How ranks start on other hosts: ssh, or slurm (srun, inside an allocation; the default "
    "there when no -H/--hostfile is given).",
    type=click.Choice(["auto", "ssh", "slurm"]),
    default="auto",
    show_default=True,
)
job_options = stacked(
    host_options,
    transport_option,
    rank_options,
    restart_options,
    limit_options,
    progress_options,
    view_options,
    ssh_options,
)
