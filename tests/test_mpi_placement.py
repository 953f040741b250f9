"""``--mpi`` placement (issue 25): what MPI_Comm_spawn starts is placed as the job is (free
slots, no binding of its own), and each rank sees only its own plumbing variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.mpi import RANK_SHIM
from launcher.transport.mpi import MpiOutput
from tests.conftest import child_env, py, run_dtrain, tagged
from tests.testhosts import TestHosts

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "mpirun").exists(), reason="pip install 'dtrain[mpi]'"
)

# Rank 0 spawns N children; each tells it how many CPUs it may run on: "unbound" when that
# is as many as rank 0 has (placed as the job is: --bind-to none), else what they had.
SPAWN = """\
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    if MPI.COMM_WORLD.Get_rank() == 0:
        n = int(sys.argv[1])
        children = MPI.COMM_SELF.Spawn(sys.executable, args=[__file__, "0"], maxprocs=n)
        cpus = [children.recv(source=i) for i in range(n)]
        children.Disconnect()
        mine = len(os.sched_getaffinity(0))
        print("children", n, "unbound" if set(cpus) == {mine} else f"{cpus} of {mine}")
    MPI.COMM_WORLD.Barrier()
else:
    parent.send(len(os.sched_getaffinity(0)), dest=0)
    parent.Disconnect()
"""


def test_spawn_uses_free_slots_unbound(mark: str, tmp_path: Path) -> None:
    """``--nproc-per-node 2`` with 3 slots to spare: MPI_Comm_spawn starts 3 processes
    there, placed and bound as the job is (Open MPI's default for them binds each to a core:
    more than this machine's free cores failed, free slots or not)."""
    pytest.importorskip("mpi4py")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: bound and unbound look the same")
    (tmp_path / "spawn.py").write_text(SPAWN)
    result = run_dtrain(
        "run", "--mpi", "-H", "localhost:5", "--nproc-per-node", "2",
        "-x", f"DTRAIN_TEST_MARK={mark}", str(tmp_path / "spawn.py"), "3", timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert tagged(result.stdout, 0) == ["children 3 unbound"]


def test_each_rank_sees_only_its_own_plumbing(mark: str) -> None:
    """mpirun forwards every rank's DTRAIN_RANK_<r> to every rank: the shim takes its own
    values and unsets them all."""
    code = (
        "import os; print(sorted(k for k in os.environ if k.startswith('DTRAIN_RANK')), "
        "os.environ['NODE_RANK'], os.environ['DTRAIN_HOST'], os.environ['CUDA_VISIBLE_DEVICES'])"
    )
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": "4,5,6"}
    result = run_dtrain(
        "run", "--mpi", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(3):
        assert tagged(result.stdout, rank) == [f"[] 0 localhost {4 + rank}"]


def test_the_shim_unsets_every_ranks_variables_and_keeps_values_whole() -> None:
    env = {
        **os.environ,
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "DTRAIN_RANK_0": "DTRAIN_HOST=a",
        "DTRAIN_RANK_1": "DTRAIN_HOST='b c $HOME'",
        "DTRAIN_RANK_2": "DTRAIN_HOST=c",
    }
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    done = subprocess.run(
        ["sh", "-c", RANK_SHIM, "dtrain-rank", sys.executable, "-c", code],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert not [k for k in seen if k.startswith("DTRAIN_RANK") or k.startswith("dtrain_")]
    assert (seen["RANK"], seen["DTRAIN_HOST"]) == ("1", "b c $HOME")


def test_what_spawn_starts_is_mpiruns_to_show_not_a_ranks() -> None:
    """A spawned child is Open MPI's job 2: its ``[2,0]`` lines are not rank 0's."""
    shown: list[tuple[int, bytes]] = []

    class Sink:
        def show(self, spec: LaunchSpec, stream: str, lines: list[bytes]) -> None:
            shown.extend((spec.rank, line) for line in lines)

        def update(self, state: object) -> None:
            pass

    specs = {r: LaunchSpec(r, Host("h"), r, (), {}) for r in range(2)}
    mpirun = LaunchSpec(-1, Host("h"), 0, (), {}, label="mpirun")
    output = MpiOutput(Sink(), specs, mpirun)
    output.show(mpirun, "stdout", [b"[1,0]<stdout>: parent", b"[2,0]<stdout>: child"])
    assert shown == [(0, b"parent"), (-1, b"[2,0]<stdout>: child")]


def test_k_ranks_a_host_leave_the_free_slots_to_spawn_in_the_mpirun_line() -> None:
    result = run_dtrain(
        "run", "--mpi", "--dry-run", "--json", "-H", "a:4,b:4", "--nproc-per-node", "2", "true"
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["hostfile"] == "a slots=4\nb slots=4\n"
    line = " ".join(shown["mpirun"])
    assert "--map-by node:INHERIT --rank-by slot" in line  # not ppr:2:node (spawn's too)


def test_spawn_over_two_hosts_k_a_host(ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    """``--nproc-per-node 2`` on two hosts of 4 slots: ranks 0, 1 on node1 and 2, 3 on
    node2 (mpirun's by-node dealing, numbered by slot), and spawn's 2 processes placed as
    the job is, unbound."""
    pytest.importorskip("mpi4py")
    script = ssh_hosts.state_dir / "spawn.py"  # the hosts share this machine's files
    script.write_text(SPAWN)
    code = "import socket; print(socket.gethostname())"
    placed = run_dtrain(
        "run", "--mpi", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:4,node2:4",
        "--nproc-per-node", "2", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), timeout=180,
    )  # fmt: skip
    assert placed.returncode == 0, placed.stderr[-3000:]
    assert [remote_tagged(placed.stdout, r) for r in range(4)] == [
        ["node1 node1"],
        ["node1 node1"],
        ["node2 node2"],
        ["node2 node2"],
    ]
    spawned = run_dtrain(
        "run", "--mpi", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:4,node2:4",
        "--nproc-per-node", "2", "-x", f"DTRAIN_TEST_MARK={mark}", sys.executable, str(script),
        "2", timeout=180,
    )  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    assert remote_tagged(spawned.stdout, 0) == ["node1 children 2 unbound"]


def remote_tagged(output: str, rank: int) -> list[str]:
    """Rank ``rank``'s lines of a job with remote hosts (``[0@node1] text``), as
    ``host text``."""
    prefix = f"[{rank}@"
    return [
        line[len(prefix) :].replace("] ", " ", 1)
        for line in output.splitlines()
        if line.startswith(prefix)
    ]
