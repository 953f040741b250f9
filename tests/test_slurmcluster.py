"""The Slurm test cluster itself (tests/slurmcluster.py): what the Slurm transport's tests
rely on.  A slurmctld here, a slurmd on each SSH test host node1..node3 in its own network
namespace and hostname; salloc, srun (--overlap inside an allocation), sbatch and scancel
against it; nothing left behind by scancel, by stop() or after a crash.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge
(scripts/install-test-deps.sh); skipped otherwise.  Run alone with
``pytest -m slurm tests/test_slurmcluster.py``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, marked_pids, wait_for_pids, wait_until_gone
from tests.slurmcluster import (
    STATE_PREFIX,
    SlurmCluster,
    _our_processes,
    cleanup_leftovers,
    unavailable_reason,
)
from tests.testhosts import TestHosts, processes_in

pytestmark = pytest.mark.slurm


@contextlib.contextmanager
def allocation(cluster: SlurmCluster, *options: str) -> Iterator[dict[str, str]]:
    """``salloc --no-shell OPTIONS``: the environment of a shell inside the allocation (its
    job id, for srun); the job is cancelled at the end."""
    out = cluster.run(["salloc", "--no-shell", *options], check=True)
    job_id = next(word for word in out.stderr.split() if word.isdigit())
    env = cluster.env()
    env["SLURM_JOB_ID"] = job_id
    try:
        yield env
    finally:
        cluster.run(["scancel", job_id])


def wait_for_steps(cluster: SlurmCluster, count: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(steps := cluster.steps()) < count:
        assert time.monotonic() < deadline, f"expected {count} running steps, have {steps}"
        time.sleep(0.05)
    return steps


def node_of(hosts: TestHosts, pid: int) -> str | None:
    """The test host whose network namespace ``pid`` is in."""
    return next((name for name in hosts.names if pid in processes_in(name)), None)


def test_srun_runs_a_task_on_every_node(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run(["srun", "-N3", "hostname"], check=True)
    assert sorted(out.stdout.split()) == ["node1", "node2", "node3"] == slurm_cluster.names


def test_salloc_gives_the_allocations_variables(slurm_cluster: SlurmCluster) -> None:
    script = 'env; echo "hosts: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | xargs)"'
    out = slurm_cluster.run(["salloc", "-N2", "-n4", "sh", "-c", script], check=True)
    env = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert env["SLURM_TASKS_PER_NODE"] == "2(x2)"
    assert (env["SLURM_NNODES"], env["SLURM_NTASKS"]) == ("2", "4")
    hosts = out.stdout.split("hosts: ", 1)[1].split()
    assert len(hosts) == 2 and set(hosts) <= set(slurm_cluster.names)
    assert env["SLURM_JOB_NODELIST"] in ("node[1-2]", "node[1,3]", "node[2-3]")
    assert env["SLURM_CONF"] == str(slurm_cluster.conf)


def test_an_overlapping_step_runs_on_the_node_it_names(slurm_cluster: SlurmCluster) -> None:
    """Inside an allocation whose CPUs a step holds, ``srun --overlap --nodelist=node2``
    still starts at once, in node2's network and UTS namespaces."""
    hosts = slurm_cluster.hosts
    with allocation(slurm_cluster, "-N3", "-n3") as env:
        holder = subprocess.Popen(
            ["srun", "-N3", "-n3", "sleep", "300"], env=env, stderr=subprocess.DEVNULL
        )
        try:
            wait_for_steps(slurm_cluster, 1)
            script = "hostname; readlink /proc/self/ns/net /proc/self/ns/uts"
            step = ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node2", "--overlap"]
            out = subprocess.run(
                [*step, "sh", "-c", script], env=env, capture_output=True, text=True, timeout=30
            )
        finally:
            slurm_cluster.run(["scancel", env["SLURM_JOB_ID"]])
            holder.wait(timeout=30)
    sshd = hosts.pids["node2"]
    node2 = ["node2", os.readlink(f"/proc/{sshd}/ns/net"), os.readlink(f"/proc/{sshd}/ns/uts")]
    assert out.stdout.split() == node2, out.stderr
    assert os.readlink(f"/proc/{hosts.pids['node1']}/ns/net") != node2[1]


def test_sbatch_runs_a_script_that_writes_its_output_file(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n#SBATCH -N2\necho batch on $(hostname)\nsrun hostname\n")
    out = slurm_cluster.run(
        ["sbatch", "--wait", f"--output={tmp_path}/out-%j.txt", str(script)],
        check=True,
        cwd=tmp_path,
    )
    job_id = out.stdout.split()[-1]
    lines = (tmp_path / f"out-{job_id}.txt").read_text().splitlines()
    assert lines[0] == "batch on node1"  # the batch script runs on the first node
    assert sorted(lines[1:]) == ["node1", "node2"]


def test_scancel_leaves_no_step_and_no_process(slurm_cluster: SlurmCluster, mark: str) -> None:
    env = slurm_cluster.env()
    env["DTRAIN_TEST_MARK"] = mark
    # each task leaves a background child: scancel must end the whole tree
    task = ["sh", "-c", "sleep 300 & exec sleep 301"]
    job = slurm_cluster.run(
        ["sbatch", "-N3", "--wrap", f"srun -N3 -n3 {shlex.join(task)}"], env=env
    )
    job_id = job.stdout.split()[-1]
    pids = wait_for_pids(mark, 8)  # the batch shell and its srun, and per node a task's 2 sleeps
    wait_for_steps(slurm_cluster, 2)  # the batch step and the srun step
    assert {node_of(slurm_cluster.hosts, pid) for pid in pids} == {"node1", "node2", "node3"}
    slurm_cluster.run(["scancel", job_id], check=True)
    assert wait_until_gone(mark, timeout=30) == []
    slurm_cluster.wait_idle(timeout=30)
    assert slurm_cluster.steps() == [] and slurm_cluster.jobs() == []
    assert all(slurm_cluster.job_processes(name) == [] for name in slurm_cluster.names)


def test_stop_leaves_no_daemon_no_job_and_no_state(slurm_cluster: SlurmCluster, mark: str) -> None:
    env = slurm_cluster.env()
    env["DTRAIN_TEST_MARK"] = mark
    slurm_cluster.run(["sbatch", "-N3", "--wrap", "srun -N3 sleep 300"], env=env, check=True)
    wait_for_pids(mark, 5)  # the batch shell and its srun, a task per node
    state = slurm_cluster.state_dir
    slurm_cluster.stop()  # the next test's fixture starts a new cluster
    assert marked_pids(mark) == []
    assert str(state) not in _our_processes().values() and not state.exists()
    hosts = slurm_cluster.hosts
    assert all(processes_in(name) == [hosts.pids[name]] for name in hosts.names)
    slurm_cluster.stop()  # idempotent


CRASHING = """
import sys
from tests.testhosts import TestHosts
from tests.slurmcluster import SlurmCluster
cluster = SlurmCluster(TestHosts.attach(sys.argv[1])).start()
print(cluster.state_dir, flush=True)
cluster.run(["sbatch", "-N3", "--wrap", "srun -N3 sleep 300"], check=True)
sys.stdin.read()
"""


def test_cleanup_after_a_crashed_run(slurm_cluster_session: SlurmCluster, mark: str) -> None:
    """A test process killed with its cluster running: cleanup_leftovers() (also run by the
    next start()) ends its daemons and jobs and removes its state dir."""
    slurm_cluster_session.stop()  # one cluster at a time on the test hosts
    hosts = slurm_cluster_session.hosts
    env = {**os.environ, "PYTHONPATH": str(REPO), "DTRAIN_TEST_MARK": mark}
    crashing = subprocess.Popen(
        [sys.executable, "-c", CRASHING, str(hosts.state_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    state = Path(crashing.stdout.readline().strip())  # type: ignore[union-attr]
    assert state.name.startswith(STATE_PREFIX)
    wait_for_pids(mark, 5)  # the batch shell and its srun, a task per node
    crashing.kill()
    crashing.wait()
    assert str(state) in _our_processes().values(), "the daemons should outlive their owner"
    cleanup_leftovers()
    assert str(state) not in _our_processes().values() and marked_pids(mark) == []
    assert not state.exists()


def test_cleanup_leaves_a_running_cluster_alone(slurm_cluster: SlurmCluster) -> None:
    cleanup_leftovers()  # as another test run's start() would
    assert slurm_cluster.healthy() and slurm_cluster.conf.exists()
    out = slurm_cluster.run(["srun", "-N3", "hostname"], check=True)
    assert sorted(out.stdout.split()) == slurm_cluster.names


def test_the_reason_it_cannot_run_is_none_here() -> None:
    """Where the tests run as root with Slurm installed (CI), nothing may skip them."""
    if os.geteuid() != 0:
        pytest.skip("not root: the Slurm tests skip, saying so")
    assert unavailable_reason() is None
