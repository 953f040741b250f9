"""A job as a Slurm batch script, instead of running it (pure): ``dtrain export slurm``.

The script has ``#SBATCH`` lines for the allocation (nodes, tasks per node, GPUs, time,
partition...) and a body that runs ``dtrain run`` with the same program inside it, one rank
per Slurm task.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.config import JobConfig, pick
from launcher.core.env import parse_export
from launcher.core.export import Shape, default_name, describe_shape, job_config, job_shape


@dataclass(frozen=True)
class SlurmBatch:
    """``dtrain export slurm``'s own options: what the ``#SBATCH`` lines say."""

    name: str | None = None  # --job-name (default: after the program)
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    output: str | None = None  # default NAME-%j.out in the submit directory
    sbatch: tuple[str, ...] = ()  # more sbatch options, one #SBATCH line each
    dtrain: str = "dtrain"  # the command that runs dtrain on the nodes


def slurm_config(options: Mapping[str, Any]) -> tuple[JobConfig, SlurmBatch]:
    """``dtrain export slurm``'s options as the job and its batch settings."""
    return job_config(options), pick(SlurmBatch, {k: v for k, v in options.items() if v})


def render_sbatch(config: JobConfig, batch: SlurmBatch) -> str:
    """The batch script: ``#SBATCH`` lines, then ``dtrain run`` with the same program.

    ``-x NAME=VALUE`` becomes an ``export`` line in the script (the value is written there,
    as the user typed it) and ``-x NAME`` on dtrain's command line, so no value reaches an
    argv on the nodes; ``-x NAME`` and ``--env-file`` are resolved when the job runs.
    """
    shape = job_shape(config.placement)
    name = batch.name or default_name(config.command)
    directives = [
        f"--job-name={slurm_word(name, '--job-name')}",
        *slurm_layout(shape),
        *slurm_gpus(shape, config.placement.gpus_per_rank),
        *([f"--time={slurm_time(batch.time)}"] if batch.time else []),
        *([f"--partition={slurm_word(batch.partition, '--partition')}"] if batch.partition else []),
        *([f"--account={slurm_word(batch.account, '--account')}"] if batch.account else []),
        f"--output={slurm_word(batch.output or name + '-%j.out', '--output')}",
        *([f"--chdir={slurm_word(config.env.workdir, '--workdir')}"] if config.env.workdir else []),
        *(sbatch_option(option) for option in batch.sbatch),
    ]
    exports, names = split_exports(config.env.exports)
    lines = [
        "#!/bin/bash",
        f"# Written by dtrain export slurm: {describe_shape(shape)}. Submit: sbatch FILE",
        *(f"#SBATCH {directive}" for directive in directives),
        "set -eu",
        *(f"export {name}={shlex.quote(value)}" for name, value in exports.items()),
        "exec " + dtrain_run_line(config, batch.dtrain, names),
    ]
    return "\n".join(lines) + "\n"


def slurm_layout(shape: Shape) -> list[str]:
    """Nodes and tasks: per node when every node has as many, else the total."""
    if shape.nodes is None:
        return [f"--ntasks={shape.ranks}"]
    if shape.per_node is None:
        return [f"--nodes={shape.nodes}", f"--ntasks={shape.ranks}"]
    return [f"--nodes={shape.nodes}", f"--ntasks-per-node={shape.per_node}"]


def slurm_gpus(shape: Shape, gpus_per_rank: int | None) -> list[str]:
    """GPUs as generic resources per node where the tasks per node are known (any Slurm
    with GPUs configured takes that), else per task (Slurm 19.05+)."""
    if not gpus_per_rank:
        return []
    if gpus_per_rank < 0:
        raise UsageError(f"--gpus-per-rank {gpus_per_rank}: must be at least 1")
    if shape.per_node is not None:
        return [f"--gres=gpu:{gpus_per_rank * shape.per_node}"]
    return [f"--gpus-per-task={gpus_per_rank}"]


SLURM_TIME = re.compile(
    r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2}"
    r"|UNLIMITED|INFINITE)\Z"
)
DURATION = re.compile(r"(\d+)([smhd])\Z")


def slurm_time(text: str) -> str:
    """Slurm's time limit forms (``90``, ``1:30:00``, ``2-12``...), or ``30m``, ``12h``, ``2d``
    written in Slurm's form."""
    text = text.strip()
    if SLURM_TIME.match(text.upper()):
        return text.upper() if text.isalpha() else text
    found = DURATION.match(text.lower())
    if not found:
        raise UsageError(
            f"--time {text!r}: not a time limit",
            "write minutes (90), H:MM:SS (1:30:00), D-HH (2-12), or 30m, 12h, 2d",
        )
    seconds = int(found[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[found[2]]
    days, rest = divmod(max(seconds, 60), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def slurm_word(value: str, flag: str) -> str:
    """A value for an ``#SBATCH`` line: sbatch splits them at blanks."""
    if not value or any(c.isspace() or not c.isprintable() for c in value) or '"' in value:
        raise UsageError(
            f"{flag} {value!r}: #SBATCH lines take no blanks, quotes or control characters",
            f"give {flag} a single word",
        )
    return value


def sbatch_option(option: str) -> str:
    """One more sbatch option as given (``--mem=64G``), on a line of its own."""
    if not option.startswith("-") or "\n" in option or "\r" in option:
        raise UsageError(
            f"--sbatch {option!r}: expected one sbatch option", "write e.g. --sbatch=--mem=64G"
        )
    return option


def split_exports(exports: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``-x`` items as the values written into the script and the names given to dtrain."""
    values: dict[str, str] = {}
    names: list[str] = []
    for item in exports:
        name, value = parse_export(item)
        if value is not None:
            values[name] = value
        if name not in names:
            names.append(name)
    return values, names


def dtrain_run_line(config: JobConfig, dtrain: str, names: Sequence[str]) -> str:
    """``dtrain run -np "$SLURM_NTASKS" ... COMMAND``: one rank per Slurm task."""
    try:
        program = shlex.split(dtrain)
    except ValueError as exc:
        raise UsageError(
            f"--dtrain {dtrain!r}: {exc}", "write e.g. --dtrain /opt/venv/bin/dtrain"
        ) from None
    if not program:
        raise UsageError("--dtrain is empty", "write e.g. --dtrain /opt/venv/bin/dtrain")
    placement, flags = config.placement, []
    if placement.gpus_per_rank:
        flags += ["--gpus-per-rank", str(placement.gpus_per_rank)]
    for path in config.env.env_files:
        flags += ["--env-file", path]
    for name in names:
        flags += ["-x", name]
    flags += ["--tf"] if config.env.tf_config else []
    flags += ["--python", config.python] if config.python else []
    flags += ["--no-python"] if config.no_python else []
    flags += ["-m"] if config.module else []
    flags += ["--max-restarts", str(config.max_restarts)] if config.max_restarts else []
    flags += ["--checkpoint-dir", config.checkpoint_dir] if config.checkpoint_dir else []
    words = [*program, "run", "-np"]
    return shlex.join(words) + ' "$SLURM_NTASKS" ' + shlex.join([*flags, *config.command])
