"""The job's options, each named as the config field it sets, as one ``JobConfig`` (pure).

The edges (``dtrain run``/``ps``/``sweep``/``export``, the Python API through the run
command's parser) hand their options here by field name; other launchers' forms of a value
(``--map-by ppr:2:node``, ``--nproc-per-node auto``, ``--nnodes 2:2``, ``--rdzv-endpoint
host:port``, ``--redirects 3``) are turned into dtrain's first.  ``core/config.py`` holds
the config's types and its checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.bounds import DIGITS, MAX_HOSTS, MAX_RANKS, parse_count
from launcher.core.config import (
    EnvConfig,
    JobConfig,
    MpiConfig,
    PerNode,
    PlacementConfig,
    PsConfig,
    SshConfig,
    ViewConfig,
    pick,
)
from launcher.core.options import MPI_ONLY


def config_from_options(
    options: Mapping[str, Any], ps: PsConfig | None = None, mpi: MpiConfig | None = None
) -> JobConfig:
    """``dtrain run``'s or ``dtrain ps``'s options as one value: each option is named as the
    field it sets (ps has no -np, --tf...: those keep their defaults)."""
    options = with_peer_meanings(options)
    if mpi is None:
        check_mpi_only(options)
    if options.get("verbose"):  # dtrain's steps go between the lines: no live area
        options["plain"] = True
    return JobConfig(
        placement=pick(PlacementConfig, options),
        env=pick(EnvConfig, options),
        ssh=pick(SshConfig, options),
        view=pick(ViewConfig, options),
        ps=ps,
        mpi=mpi,
        **{name: options.get(name, default) for name, default in job_fields().items()},
    )


def run_options_config(options: Mapping[str, Any]) -> JobConfig:
    """``dtrain run``'s options (its command line's or ``launch()``'s, the project file's
    under them) as the job's config; with --mpi (or deepspeed's ``--launcher openmpi``),
    mpirun's own settings."""
    wants_mpi = options["mpi"] or options.get("launcher") == "openmpi"
    mca = tuple((str(name), str(value)) for name, value in options["mca"])
    mpi = MpiConfig(options["mpirun"], mca, options["mpirun_args"]) if wants_mpi else None
    return config_from_options(options, mpi=mpi)


def check_mpi_only(options: Mapping[str, Any]) -> None:
    """mpirun's own settings: without --mpi nothing reads them, so giving one is a mistake."""
    for row in MPI_ONLY:
        if options.get(row.field):
            raise UsageError(
                f"{row.flag} is for jobs run through mpirun, and --mpi is not given",
                f"add --mpi, or drop {row.flag}",
            )


NESTED = ("placement", "env", "ssh", "view", "ps", "mpi", "job_id")


def job_fields() -> dict[str, Any]:
    """JobConfig's own options (not a concern's) with their defaults: what the commands give."""
    return {f.name: f.default for f in fields(JobConfig) if f.name not in NESTED}


def with_peer_meanings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Values in other launchers' forms, in dtrain's: ``--map-by ppr:2:node``,
    ``--nproc-per-node auto``, ``--nnodes 2:2``, ``--rdzv-endpoint host:port``, ..."""
    result = dict(options)
    if isinstance(result.get("map_by"), str):
        result.update(parse_map_by(result["map_by"], result.get("nproc_per_node")))
    if isinstance(result.get("nproc_per_node"), str):
        result["nproc_per_node"] = parse_per_node(result["nproc_per_node"])
    if isinstance(result.get("nnodes"), str):
        result["nnodes"] = parse_nnodes(result["nnodes"])
    if result.get("rdzv_endpoint"):
        host, _, port = str(result.pop("rdzv_endpoint")).rpartition(":")
        if not host or not DIGITS.fullmatch(port) or len(port) > 5:
            raise UsageError(
                f"--rdzv-endpoint {options['rdzv_endpoint']}: expected HOST:PORT",
                "write e.g. --rdzv-endpoint node1:29400",
            )
        result["master_addr"], result["master_port"] = host.strip("[]"), int(port)
    launcher = result.pop("launcher", None)
    if launcher is not None and launcher not in ("pdsh", "ssh", "openmpi"):
        raise UsageError(
            f"--launcher {launcher}: dtrain starts ranks over ssh, or through mpirun with --mpi",
            "use --launcher pdsh (the default) or openmpi (--mpi)",
        )
    address = result.get("master_addr")
    if isinstance(address, str) and address.startswith("[") and address.endswith("]"):
        result["master_addr"] = address[1:-1]  # an IPv6 address as in -H: MASTER_ADDR has none
    if result.get("redirects") is not None:
        result.update(parse_redirects(str(result.pop("redirects"))))
    return result


def parse_redirects(text: str) -> dict[str, Any]:
    """torchrun's ``--redirects``: 1 stdout, 2 stderr, 3 both go to the files only (dtrain's
    job directory and --output-dir always have them): off the terminal."""
    hidden = {"0": (), "1": ("stdout",), "2": ("stderr",), "3": ("stdout", "stderr")}
    if text.strip() not in hidden:
        raise UsageError(
            f"--redirects {text}: dtrain takes 0, 1, 2 or 3 for every rank",
            "choose the ranks the terminal shows with --ranks or --local-ranks",
        )
    streams = hidden[text.strip()]
    return {"quiet": True} if len(streams) == 2 else {"hide": streams}


def parse_map_by(text: str, per_node: object) -> dict[str, Any]:
    """mpirun's ``--map-by``: slot, node, core (as slot), ``ppr:N:node``; ``:OVERSUBSCRIBE``."""
    base, *modifiers = text.split(":")
    found: dict[str, Any] = {"map_by": "slot"}
    if base.lower() == "ppr" and len(modifiers) >= 2 and modifiers[1].lower() == "node":
        try:
            count = parse_count("N", modifiers[0], MAX_RANKS)
        except UsageError:  # (its words would be "--map-by ppr:N:node 0", no line to type)
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise UsageError(
                f"--map-by {shown}: N of ppr:N:node must be from 1 to {MAX_RANKS:,}",
                "write e.g. --map-by ppr:2:node",
            ) from None
        if count is None:
            raise UsageError(
                f"--map-by {text}: ppr needs a count", "write e.g. --map-by ppr:2:node"
            )
        if per_node is not None:
            raise UsageError(f"--map-by {text} and --nproc-per-node both given", "use one of them")
        found["nproc_per_node"], modifiers = count, modifiers[2:]
    elif base.lower() in ("slot", "node", "core"):
        found["map_by"] = "node" if base.lower() == "node" else "slot"
    else:
        raise UsageError(
            f"--map-by {text}: dtrain maps by slot, node (round robin) or ppr:N:node",
            map_by_hint(base),
        )
    for modifier in modifiers:
        if modifier.upper() not in ("OVERSUBSCRIBE", "NOOVERSUBSCRIBE"):
            raise UsageError(
                f"--map-by {text}: unknown modifier {modifier!r}",
                "dtrain takes :OVERSUBSCRIBE; bind CPUs with --bind-to core",
            )
        if modifier.upper() == "OVERSUBSCRIBE":
            found["oversubscribe"] = True
    return found


# mpirun's other mapping policies: dtrain has none of them (a typo of slot or node is not one)
MPIRUN_POLICIES = ("hwthread", "l1cache", "l2cache", "l3cache", "numa", "package", "socket")


def map_by_hint(base: str) -> str:
    """``--map-by nod``: did you mean node; mpirun's ``socket`` (or another policy of its):
    what dtrain offers instead."""
    import difflib

    close = difflib.get_close_matches(base.lower(), ("slot", "node"), n=1, cutoff=0.75)
    if close and base.lower() not in MPIRUN_POLICIES:
        return f"did you mean --map-by {close[0]}?"
    return "for per-socket placement use --nproc-per-node with --bind-to socket"


def parse_per_node(text: str) -> int | PerNode:
    """``--nproc-per-node``: a count, or auto (GPUs, else cores), gpu, cpu (torchrun's)."""
    word = text.strip().lower()
    if word in ("auto", "gpu", "cpu"):
        return word  # type: ignore[return-value]
    count = parse_count("--nproc-per-node", word, MAX_RANKS)
    if count is not None:
        return count
    raise UsageError(
        f"--nproc-per-node {text}: expected a number, auto, gpu or cpu",
        "write e.g. --nproc-per-node 4 (auto: one per GPU, else one per core)",
    )


def parse_nnodes(text: str) -> int:
    """``--nnodes N`` (or torchrun's ``N:N``); an elastic MIN:MAX range is refused."""
    low, colon, high = text.strip().partition(":")
    count = parse_count("--nnodes", low, MAX_HOSTS)
    if count is not None and (not colon or high == low):
        return count
    if colon and DIGITS.fullmatch(low) and DIGITS.fullmatch(high):
        raise UsageError(
            f"--nnodes {text}: elastic node ranges are not supported yet",
            f"give the number of hosts, e.g. --nnodes {high}",
        )
    raise UsageError(f"--nnodes {text}: expected a number of hosts", "write e.g. --nnodes 2")
