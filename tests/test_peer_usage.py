"""Peers' command lines for real: the issue's mpirun, torchrun and deepspeed spellings run jobs
(local processes, and the SSH test hosts where hosts matter)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import child_env, run_dtrain, wait_until_gone
from tests.testhosts import TestHosts

SHOW = (
    "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], "
    "sorted(os.sched_getaffinity(0)), os.environ.get('DTRAIN_CPUS'), "
    "os.environ.get('CUDA_VISIBLE_DEVICES'), os.uname().nodename)\n"
)


def shown(stdout: str) -> dict[int, list[str]]:
    """rank -> the fields SHOW printed (tag dropped)."""
    rows = {}
    for line in stdout.splitlines():
        text = line.split("] ", 1)[1]
        fields = re.match(r"(\d+) (\d+) (\d+) (\[[^\]]*\]) (\S+) (\S+) (\S+)", text)
        assert fields, line
        rows[int(fields[1])] = list(fields.groups())
    return rows


def my_cpus_split(ranks: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    if n >= ranks:
        return [cpus[i * n // ranks : (i + 1) * n // ranks] for i in range(ranks)]
    return [[cpus[i % n]] for i in range(ranks)]


def test_mpirun_spelling_binds_each_rank_to_its_cores(tmp_path: Path, mark: str) -> None:
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "train.py").write_text(SHOW)
    result = run_dtrain(
        "run", "-n", "2", "-hostfile", "hosts", "--tag-output", "--bind-to", "core",
        "--report-bindings", "-x", f"DTRAIN_TEST_MARK={mark}", "python", "train.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = shown(result.stdout)
    for rank, cpus in enumerate(my_cpus_split(2)):
        assert rows[rank][3] == str(cpus)  # what the kernel says the rank may run on
        assert rows[rank][4] == ",".join(map(str, cpus))
        assert f"dtrain: rank {rank} on localhost (local rank {rank}): cpus {rows[rank][4]}, " in (
            result.stderr
        )
    assert wait_until_gone(mark) == []


def test_nproc_per_node_auto_counts_the_visible_gpus(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SHOW)
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": "0,1,2"}
    result = run_dtrain("run", "--nproc_per_node=auto", "train.py", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = shown(result.stdout)
    assert sorted(rows) == [0, 1, 2]
    assert [rows[r][5] for r in range(3)] == ["0", "1", "2"]  # one GPU each
    env["CUDA_VISIBLE_DEVICES"] = "-1"  # no GPU: one rank per core
    cores = run_dtrain("run", "--nproc-per-node", "auto", "train.py", env=env, cwd=tmp_path)
    assert cores.returncode == 0, cores.stderr
    assert len(shown(cores.stdout)) == len(os.sched_getaffinity(0))


def test_a_module_and_torchruns_variables(tmp_path: Path) -> None:
    (tmp_path / "detect.py").write_text(
        "import os\n"
        "assert 'TORCHELASTIC_RUN_ID' in os.environ  # how scripts tell torchrun is there\n"
        "print(*(os.environ[v] for v in ('RANK', 'ROLE_NAME', 'ROLE_RANK', 'ROLE_WORLD_SIZE',\n"
        "      'GROUP_WORLD_SIZE', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_MAX_RESTARTS')),\n"
        "      os.environ['TORCHELASTIC_RUN_ID'] == os.environ['DTRAIN_JOB_ID'])\n"
    )
    result = run_dtrain(
        "run", "--standalone", "--nproc_per_node", "2", "-m", "detect", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[0] 0 default 0 2 1 0 0 True",
        "[1] 1 default 1 2 1 0 0 True",
    ]


def test_verbose_says_what_dtrain_does_with_timestamps(tmp_path: Path) -> None:
    result = run_dtrain("run", "-v", "-np", "2", "true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = [
        ln for ln in result.stderr.splitlines() if re.match(r"dtrain \d\d:\d\d:\d\d\.\d{3} ", ln)
    ]
    said = " | ".join(line.split(" ", 2)[2] for line in steps)
    assert "plan 2 rank(s): localhost x2" in said
    assert (
        "rank 0 started on localhost (pid " in said and "rank 1 on localhost exited with 0" in said
    )


@pytest.mark.sshhosts
def test_torchrun_spelling_over_ssh_hosts(ssh_hosts: TestHosts, tmp_path: Path, mark: str) -> None:
    (tmp_path / "train.py").write_text(SHOW)
    result = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "--nproc_per_node=2", "--nnodes", "2",
        "-H", "node1,node2,node3", "--bind-to", "core", "-x", f"DTRAIN_TEST_MARK={mark}",
        "train.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = shown(result.stdout)
    assert [(rows[r][1], rows[r][2], rows[r][6]) for r in range(4)] == [
        ("0", "4", "node1"), ("1", "4", "node1"), ("0", "4", "node2"), ("1", "4", "node2"),
    ]  # fmt: skip
    for rank in range(4):  # bound remotely too, by the CPUs the host's probe found
        assert rows[rank][3] == str(my_cpus_split(2)[rank % 2])
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_deepspeed_spelling_over_ssh_hosts(ssh_hosts: TestHosts, tmp_path: Path, mark: str) -> None:
    (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\nnode3 slots=2\n")
    (tmp_path / "train.py").write_text(SHOW)
    result = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "--include", "node1@node3:1",
        "-H", "hosts", "--num_gpus", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "train.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "-H hosts: reading the hostfile" in result.stderr
    rows = shown(result.stdout)
    # node1: one rank, no GPU known there (unbound); node3: its GPU 1 only
    assert [(rows[r][6], rows[r][5]) for r in range(2)] == [("node1", "None"), ("node3", "1")]
    assert wait_until_gone(mark) == []
