"""Each rank's environment (pure: the base environment comes in as an argument).

``build_env`` returns only the variables dtrain sets; the transport lays them
over the launcher's own environment (locally) or passes them inline (SSH).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from launcher.base.errors import EnvError
from launcher.core.plan import Plan, Rank

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# -x 'WANDB_*': name characters and fnmatch's wildcards (a class may hold ! and ranges).
ENV_PATTERN = re.compile(r"[A-Za-z0-9_*?\[\]!-]+\Z")
# Linux's MAX_ARG_STRLEN: the longest NAME=value string one process may be given (a longer
# one makes every rank's exec fail with E2BIG).
MAX_VARIABLE_BYTES = 128 * 1024


@dataclass(frozen=True)
class EnvOptions:
    """What every rank's environment is built from."""

    job_id: str
    master_addr: str
    master_port: int
    extra: Mapping[str, str] = field(default_factory=dict)  # -x and --env-file, already resolved
    base_env: Mapping[str, str] = field(default_factory=dict)  # the launcher's environment
    tf_config: Mapping[int, str] = field(default_factory=dict)  # rank -> TF_CONFIG json
    host_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # per host name
    groups: Mapping[str, int] = field(default_factory=dict)  # role -> its ranks (ps jobs)
    nodes: int = 1  # hosts with ranks: torchrun's GROUP_WORLD_SIZE
    restart_count: int = 0
    max_restarts: int = 0
    error_files: Mapping[int, str] = field(default_factory=dict)  # rank -> its error file


def build_env(rank: Rank, options: EnvOptions) -> dict[str, str]:
    """The variables dtrain sets for one rank, user extras applied last."""
    env = {
        "RANK": str(rank.rank),
        "WORLD_SIZE": str(rank.world_size),
        "LOCAL_RANK": str(rank.local_rank),
        "LOCAL_WORLD_SIZE": str(rank.local_world_size),
        "NODE_RANK": str(rank.node_rank),
        "GROUP_RANK": str(rank.node_rank),
        "MASTER_ADDR": options.master_addr,
        "MASTER_PORT": str(options.master_port),
        **torchrun_env(rank, options),
        "DTRAIN_JOB_ID": options.job_id,
        "DTRAIN_RESTART_COUNT": str(options.restart_count),
        "DTRAIN_HOST": rank.host.name,
        "DTRAIN_ROLE": rank.role,
        "PYTHONUNBUFFERED": "1",
    }
    if rank.local_world_size > 1 and "OMP_NUM_THREADS" not in options.base_env:
        # torchrun does the same: N ranks x all cores each thrash a shared host.
        env["OMP_NUM_THREADS"] = "1"
    if rank.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(rank.gpus)
    if rank.cpus is not None:  # the watchdog pins the rank to them (--bind-to)
        env["DTRAIN_CPUS"] = ",".join(map(str, rank.cpus))
    if rank.rank in options.tf_config:
        env["TF_CONFIG"] = options.tf_config[rank.rank]
    env.update(options.host_env.get(rank.host.name, {}))
    env.update(options.extra)
    return env


def torchrun_env(rank: Rank, options: EnvOptions) -> dict[str, str]:
    """The rest of torchrun's contract, so scripts that read it (or detect torchrun) run as is.

    A job without roles is torchrun's one role, ``default``; in parameter-server jobs
    each role (chief, worker, ps, evaluator) is a role group of its own.
    ``TORCHELASTIC_ERROR_FILE`` (where torch's ``@record`` writes an uncaught exception) is
    set for the ranks that have a file of their own (``options.error_files``).
    """
    grouped = rank.role in options.groups
    return {
        "ROLE_NAME": rank.role if grouped else "default",
        "ROLE_RANK": str(rank.task_index if grouped else rank.rank),
        "ROLE_WORLD_SIZE": str(options.groups.get(rank.role, rank.world_size)),
        "GROUP_WORLD_SIZE": str(options.nodes),
        "TORCHELASTIC_RUN_ID": options.job_id,
        "TORCHELASTIC_RESTART_COUNT": str(options.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
        **(
            {"TORCHELASTIC_ERROR_FILE": options.error_files[rank.rank]}
            if rank.rank in options.error_files
            else {}
        ),
    }


def build_tf_configs(
    plan: Plan, ports: Mapping[int, int], addresses: Mapping[str, str]
) -> dict[int, str]:
    """``TF_CONFIG`` for MultiWorkerMirroredStrategy: every rank a worker.

    ``ports`` maps rank -> a port free on its host; ``addresses`` maps a host
    name to the address the other ranks reach it by.
    """
    workers = [
        f"{format_host_port(addresses.get(r.host.name, r.host.name), ports[r.rank])}"
        for r in plan.ranks
    ]
    return {
        r.rank: json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": r.rank}},
            separators=(",", ":"),
        )
        for r in plan.ranks
    }


# gRPC would send TensorFlow's traffic through these.
PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "grpc_proxy",
    "no_grpc_proxy",
)


def build_ps_tf_configs(
    plan: Plan, ports: Mapping[int, int], addresses: Mapping[str, str]
) -> dict[int, str]:
    """``TF_CONFIG`` for ParameterServerStrategy: the same cluster in every task.

    The cluster lists chief, workers and ps by task index; an evaluator is
    not part of the cluster (TensorFlow's convention) but gets its task.
    """
    cluster: dict[str, list[str]] = {}
    for rank in plan.ranks:
        if rank.role != "evaluator":
            address = addresses.get(rank.host.name, rank.host.name)
            cluster.setdefault(rank.role, []).append(format_host_port(address, ports[rank.rank]))
    return {
        r.rank: json.dumps(
            {"cluster": cluster, "task": {"type": r.role, "index": r.task_index}},
            separators=(",", ":"),
        )
        for r in plan.ranks
    }


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """Parse dotenv syntax: ``NAME=value``, ``export NAME=value``, quotes, ``#`` comments."""
    result: dict[str, str] = {}
    # split on "\n" only, so line numbers match what an editor shows ("\r\n" ends a line too)
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}: {raw.strip()!r}"
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep:
            raise EnvError(f"{where}: expected NAME=value", "write e.g. 'NCCL_DEBUG=INFO'")
        if not ENV_NAME.match(name):
            raise EnvError(
                f"{where}: {name!r} is not a valid variable name",
                "names are letters, digits and '_', not starting with a digit",
            )
        result[name] = parse_env_value(value.strip(), where)
        check_env_value(name, result[name], f"{source}:{number}: {name}")
    return result


def check_env_value(name: str, value: str, where: str) -> None:
    """A value a process can be given: no NUL byte (C strings end there: posix_spawn refuses
    it, and every rank would die of it), bytes the file system encoding can write, and
    within Linux's limit for one variable.  ``where`` names the file and line, or the -x;
    the message never shows the value, which may be a secret."""
    if "\0" in value:
        raise EnvError(
            f"{where}: the value contains a NUL byte, which no process environment can carry",
            "remove it; pass binary data in a file and the file's path in the variable",
        )
    try:
        size = len(f"{name}={value}".encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise EnvError(
            f"{where}: the value is not valid text (a lone UTF-16 surrogate)",
            "pass the value as UTF-8 text",
        ) from None
    if size >= MAX_VARIABLE_BYTES:
        raise EnvError(
            f"{where}: NAME=value is {size:,} bytes; Linux passes at most "
            f"{MAX_VARIABLE_BYTES - 1:,} in one variable",
            "pass large data in a file and the file's path in the variable",
        )


def parse_env_value(value: str, where: str) -> str:
    """A dotenv value: 'single' (literal), "double" (with \\ escapes) or bare (# ends it)."""
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = find_closing_quote(value, quote)
        if end < 0:
            raise EnvError(f"{where}: unterminated {quote} quote", f"close the value with {quote}")
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise EnvError(
                f"{where}: unexpected text after the quoted value", "quote the whole value"
            )
        inner = value[1:end]
        if quote == '"':
            inner = re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), inner)
        return inner
    comment = re.search(r"\s#", value)
    return value[: comment.start()].rstrip() if comment else value


def find_closing_quote(value: str, quote: str) -> int:
    i = 1
    while i < len(value):
        if value[i] == "\\" and quote == '"':
            i += 2
            continue
        if value[i] == quote:
            return i
        i += 1
    return -1


def resolve_env_args(
    exports: Sequence[str],
    env_files: Iterable[tuple[str, str]],
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """Merge ``--env-file`` (source, text) pairs, then ``-x NAME[=value]`` (the command line wins).

    ``-x NAME`` copies NAME from the launcher's environment, as mpirun does; ``-x PATTERN``
    (``'WANDB_*'``, fnmatch's ``*``, ``?`` and ``[...]``, case-sensitive as names are)
    copies every variable of it whose name matches, none when none does: a family of
    variables may be empty on one machine, where a variable named alone must be set.
    """
    result: dict[str, str] = {}
    for source, text in env_files:
        result.update(parse_env_file(text, source))
    for item in exports:
        name, value = parse_export(item)
        if value is not None:
            result[name] = value
        elif is_env_pattern(name):
            result.update(matching_variables(name, base_env))
        elif name in base_env:
            result[name] = base_env[name]
        else:
            raise EnvError(
                f"-x {name}: {name} is not set in dtrain's environment",
                f"export {name} first or pass -x {name}=value",
            )
    return result


def parse_export(item: str) -> tuple[str, str | None]:
    """One ``-x NAME[=VALUE]`` or ``-x PATTERN``: the name (or pattern), and the value when
    one is given (None: the value comes from the environment the job starts in, as with
    mpirun)."""
    name, sep, value = item.partition("=")
    if is_env_pattern(name):
        if sep:
            raise EnvError(
                f"-x {item!r}: a pattern copies the variables it matches from here; it takes "
                "no value",
                f"use -x {shlex_quote(name)}, or name one variable: -x NAME=value",
            )
        if not ENV_PATTERN.match(name):
            raise EnvError(
                f"-x {item!r}: not a pattern of variable names",
                "use letters, digits, '_' and the wildcards * ? [...], e.g. -x 'WANDB_*'",
            )
        return name, None
    if not ENV_NAME.match(name):
        raise EnvError(
            f"-x {item!r}: {name!r} is not a valid variable name",
            "use -x NAME, -x NAME=value or -x 'PATTERN_*'",
        )
    if sep:
        check_env_value(name, value, f"-x {name}")
    return name, value if sep else None


def copied_names(exports: Sequence[str], names: Iterable[str]) -> frozenset[str]:
    """Of the variables ``names`` (what ``resolve_env_args`` returned), those whose value came
    from dtrain's environment (``-x NAME``, ``-x PATTERN``) or an env file, not from a
    ``-x NAME=value``: what ``--dry-run`` shows by name only (they may be secrets)."""
    import fnmatch

    literal: set[str] = set()
    for item in exports:
        name, sep, _ = item.partition("=")
        if is_env_pattern(name):
            literal = {known for known in literal if not fnmatch.fnmatchcase(known, name)}
        elif sep:
            literal.add(name)
        else:
            literal.discard(name)
    return frozenset(names) - literal


def is_env_pattern(name: str) -> bool:
    """Whether one ``-x`` names a family of variables (``WANDB_*``) rather than one."""
    return any(wildcard in name for wildcard in "*?[")


def matching_variables(pattern: str, base_env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``base_env`` whose names ``pattern`` matches, by name."""
    import fnmatch

    return {name: base_env[name] for name in sorted(base_env) if fnmatch.fnmatchcase(name, pattern)}


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
