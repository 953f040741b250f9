"""A job written for another scheduler instead of run: what the exports share (pure).

``dtrain export slurm`` writes an sbatch script (``core/sbatch.py``), ``dtrain export k8s``
a Kubeflow manifest (``core/manifest.py``).  Both start from the same ``JobConfig`` as
``dtrain run`` (``optionvalues.config_from_options``), so the flags mean what they mean there,
and both lay the ranks out by the same shape: ranks, nodes and ranks per node.

Nothing here reads a file or the environment: ``-x``/``--env-file`` values arrive resolved.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.config import (
    JobConfig,
    PlacementConfig,
    PsConfig,
    validate_config,
)
from launcher.core.optionvalues import config_from_options

INTERPRETER = re.compile(r"(.*/)?python[0-9.]*\Z")


@dataclass(frozen=True)
class Shape:
    """How many ranks, on how many nodes (or pods), and how many on each."""

    ranks: int
    nodes: int | None = None  # None: the scheduler decides (Slurm's --ntasks alone)
    per_node: int | None = None  # None: not the same on every node


def job_config(options: Mapping[str, Any], ps: PsConfig | None = None) -> JobConfig:
    """An export command's options as the ``JobConfig`` ``dtrain run`` would build (the flags
    an export does not take keep their defaults), validated."""
    defaults = {f.name: f.default for f in fields(JobConfig) if f.default is not MISSING}
    return validate_config(config_from_options({**defaults, **options}, ps=ps))


def job_shape(placement: PlacementConfig) -> Shape:
    """Ranks, nodes and ranks per node from -np, --nnodes and --nproc-per-node (any two)."""
    np, nodes, per = placement.np, placement.nnodes, placement.nproc_per_node
    if isinstance(per, str):
        raise UsageError(
            f"--nproc-per-node {per}: an exported job needs a number of ranks per node",
            "write e.g. --nproc-per-node 4 (the GPUs of a node)",
        )
    for flag, value in (("-np", np), ("--nnodes", nodes)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if per is not None:
        nodes = nodes or (np // per if np else 1)
        if np is not None and np != nodes * per:
            raise UsageError(
                f"-np {np} is not {nodes} node(s) x --nproc-per-node {per}",
                "give two of -np, --nnodes and --nproc-per-node",
            )
        return Shape(nodes * per, nodes, per)
    if nodes is None:
        return Shape(np or 1)
    if np is None:
        return Shape(nodes, nodes, 1)
    if np < nodes:
        raise UsageError(f"-np {np} is fewer ranks than --nnodes {nodes}", "lower --nnodes")
    return Shape(np, nodes, np // nodes if np % nodes == 0 else None)


def describe_shape(shape: Shape) -> str:
    """``8 ranks (2 nodes x 4)`` for the header of what is written."""
    ranks = f"{shape.ranks} rank{'s' if shape.ranks != 1 else ''}"
    if shape.nodes is None:
        return ranks
    if shape.per_node is None:
        return f"{ranks} on {shape.nodes} nodes"
    return f"{ranks} ({shape.nodes} node{'s' if shape.nodes != 1 else ''} x {shape.per_node})"


def default_name(command: Sequence[str]) -> str:
    """A job name after the program (``python train.py`` -> ``train``), a DNS label."""
    words = list(command)
    if words and INTERPRETER.match(words[0]):
        words = words[1:]
    while words and words[0].startswith("-"):  # python -m pkg.mod, python -u train.py
        if words[0] == "-c":  # a program's text: no name in it
            return "dtrain-job"
        words = words[1:]
    word = words[0] if words else ""
    stem = word.rsplit("/", 1)[-1].removesuffix(".py").lower()
    stem = re.sub(r"[^a-z0-9]+", "-", stem)
    stem = re.sub(r"^[^a-z]+", "", stem)[:40].strip("-")
    return stem or "dtrain-job"
