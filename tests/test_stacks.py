"""dtrain stacks and dtrain top on running jobs, locally and over SSH; the stack grouping."""

from __future__ import annotations

import io
import json
import os
import socket
import time
from pathlib import Path

import pytest

from launcher.core.stacks import format_stacks, group_stacks
from launcher.streams.jobdir import CONTROL_SOCKET
from launcher.view.topview import top_table
from tests.conftest import JOBS, run_dtrain, start_dtrain, wait_until_gone
from tests.testhosts import TestHosts

pytestmark = pytest.mark.timeout(120)

PROGRAM = """import os, time
def wait_in_all_reduce():
    time.sleep(120)
def wander_elsewhere():
    time.sleep(120)
print("ready", flush=True)
if os.environ["RANK"] == "2":
    wander_elsewhere()
else:
    wait_in_all_reduce()
"""


def frame(name: str, line: int) -> dict[str, object]:
    return {"name": name, "filename": "train.py", "line": line}


def test_grouping_puts_the_odd_rank_apart() -> None:
    main = [
        {"thread_name": "MainThread", "frames": [frame("all_reduce", 9), frame("<module>", 20)]}
    ]
    odd = [{"thread_name": "MainThread", "frames": [frame("load", 4), frame("<module>", 18)]}]
    dumps = {r: ("node1" if r < 4 else "node2", {"threads": main}) for r in range(8)}
    dumps[5] = ("node2", {"threads": odd})
    dumps[7] = ("node2", {"error": "py-spy is not installed on this host (pip install py-spy)"})
    groups = group_stacks(dumps)
    assert [g.ranks for g in groups] == [(0, 1, 2, 3, 4, 6), (5,), (7,)]
    assert format_stacks(groups, 8) == [
        "ranks 0-4,6 of 8 on node1, node2 (main thread):",
        "    all_reduce (train.py:9)",
        "    <module> (train.py:20)",
        "",
        "rank 5 of 8 on node2 (main thread):   <-- differs from the others",
        "    load (train.py:4)",
        "    <module> (train.py:18)",
        "",
        "rank 7 of 8 on node2: no stack: py-spy is not installed on this host (pip install py-spy)",
    ]


def stacks_of_running_job(*args: str, tmp_path: Path, mark: str) -> str:
    (tmp_path / "train.py").write_text(PROGRAM)
    proc = start_dtrain("run", *args, "-x", f"DTRAIN_TEST_MARK={mark}", str(tmp_path / "train.py"))
    try:
        assert proc.stdout is not None
        for _ in range(4):
            assert "ready" in proc.stdout.readline()
        result = run_dtrain("stacks")
        assert result.returncode == 0, result.stderr
        return result.stdout
    finally:
        run_dtrain("stop")
        proc.communicate(timeout=30)


def expected(hosts: str, odd_host: str, path: Path) -> list[str]:
    return [
        f"ranks 0-1,3 of 4 on {hosts} (main thread):",
        f"    wait_in_all_reduce ({path}:3)",
        f"    <module> ({path}:10)",
        "",
        f"rank 2 of 4 on {odd_host} (main thread):   <-- differs from the others",
        f"    wander_elsewhere ({path}:5)",
        f"    <module> ({path}:8)",
        "",
    ]


def test_stacks_of_a_local_job(tmp_path: Path, mark: str) -> None:
    out = stacks_of_running_job("-np", "4", tmp_path=tmp_path, mark=mark)
    assert out.splitlines()[1:] == expected("localhost", "localhost", tmp_path / "train.py")
    assert wait_until_gone(mark) == []


def test_stacks_answer_while_another_client_of_the_job_says_nothing(
    tmp_path: Path, mark: str
) -> None:
    """A client connected to the job's control socket that sends nothing (a stuck script, a
    ``nc -U`` left open) holds up no ``dtrain stacks``."""
    (tmp_path / "train.py").write_text(PROGRAM)
    proc = start_dtrain(
        "run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", str(tmp_path / "train.py")
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        job = proc.stderr.readline().split("dtrain: job ", 1)[1].split()[0]
        for _ in range(2):
            assert "ready" in proc.stdout.readline()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(JOBS / job / CONTROL_SOCKET))
            result = run_dtrain("stacks", job, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "wait_in_all_reduce" in result.stdout
    finally:
        run_dtrain("stop")
        proc.communicate(timeout=30)
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_stacks_over_ssh(ssh_hosts: TestHosts, tmp_path: Path, mark: str) -> None:
    out = stacks_of_running_job(
        "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:2,node2:2",
        tmp_path=tmp_path, mark=mark,
    )  # fmt: skip
    assert out.splitlines()[1:] == expected("node1, node2", "node2", tmp_path / "train.py")
    assert wait_until_gone(mark) == []


def test_stacks_of_mpi_ranks(tmp_path: Path, mark: str) -> None:
    pytest.importorskip("mpi4py")
    out = stacks_of_running_job("--mpi", "-np", "4", tmp_path=tmp_path, mark=mark)
    assert out.splitlines()[1:] == expected("localhost", "localhost", tmp_path / "train.py")
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_stacks_of_mpi_ranks_over_ssh(ssh_hosts: TestHosts, tmp_path: Path, mark: str) -> None:
    pytest.importorskip("mpi4py")
    out = stacks_of_running_job(
        "--mpi", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:2,node2:2",
        tmp_path=tmp_path, mark=mark,
    )  # fmt: skip
    assert out.splitlines()[1:] == expected("node1, node2", "node2", tmp_path / "train.py")
    assert wait_until_gone(mark) == []


def running_job(before: set[Path], ranks: int, timeout_s: float = 60) -> str:
    """The id of the job started since ``before`` (JOBS' entries then), once its status
    says running with every rank's pid: a machine under load starts it late."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in set(JOBS.iterdir()) - before:
            try:
                status = json.loads((job / "status.json").read_text())
            except (OSError, ValueError):
                continue
            pids = [r.get("pid") for r in status.get("ranks", {}).values()]
            if status.get("state") == "running" and len(pids) == ranks and all(pids):
                return job.name
        time.sleep(0.05)
    raise AssertionError(f"no running job of {ranks} ranks in {JOBS} after {timeout_s} s")


def test_a_rank_that_is_not_python_says_why(mark: str) -> None:
    before = set(JOBS.iterdir())
    proc = start_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "60")
    try:
        result = run_dtrain("stacks", running_job(before, 2))
        assert result.returncode == 1
        assert "ranks 0-1 of 2 on localhost: no stack: py-spy: " in result.stdout
    finally:
        run_dtrain("stop")
        proc.communicate(timeout=30)


def test_stacks_of_a_job_that_is_not_running() -> None:
    done = run_dtrain("run", "true")
    job = done.stderr.split("dtrain: job ", 1)[1].split()[0]
    result = run_dtrain("stacks", job)
    assert result.returncode == 2
    assert result.stderr == (
        f"dtrain: error: job {job} has ended (succeeded): its ranks are gone "
        f"(hint: dtrain logs {job} shows what they said)\n"
    )


BUSY = """import os, time
print("rank", os.environ["RANK"], "busy" if os.environ["RANK"] == "0" else "idle", flush=True)
block = bytearray(64 * 2**20)  # 64 MiB resident
block[::4096] = b"x" * len(block[::4096])
end = time.time() + 60
while time.time() < end:
    if os.environ["RANK"] != "0":
        time.sleep(0.5)
"""


def top_of_running_job(*args: str, tmp_path: Path, mark: str) -> list[dict[str, object]]:
    (tmp_path / "busy.py").write_text(BUSY)
    proc = start_dtrain("run", *args, "-x", f"DTRAIN_TEST_MARK={mark}", str(tmp_path / "busy.py"))
    try:
        assert proc.stdout is not None
        for _ in range(2):
            assert "rank" in proc.stdout.readline()
        time.sleep(0.5)  # the 64 MiB are touched
        result = run_dtrain("top", "--once", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)  # type: ignore[no-any-return]
    finally:
        run_dtrain("stop")
        proc.communicate(timeout=30)


def check_top(rows: list[dict[str, object]], hosts: list[str]) -> None:
    assert [(r["rank"], r["host"], r["state"]) for r in rows] == [
        (0, hosts[0], "running"), (1, hosts[1], "running"),
    ]  # fmt: skip
    busy, idle = rows
    # A spinning rank's share depends on what else the machine runs (a busy CI machine gave
    # it 33-48 %): it is measured as clearly above the sleeping rank's, not above a fixed share.
    assert isinstance(busy["cpu_percent"], float) and isinstance(idle["cpu_percent"], float)
    assert busy["cpu_percent"] > 10 and busy["cpu_percent"] > idle["cpu_percent"] + 10, rows
    assert idle["cpu_percent"] < 20, rows
    assert all(isinstance(r["rss_mib"], float) and r["rss_mib"] > 64 for r in rows), rows
    assert [r["last_line"] for r in rows] == ["rank 0 busy", "rank 1 idle"]
    assert all(isinstance(r["pid"], int) and r["pid"] > 0 for r in rows)


def test_top_once_as_json(tmp_path: Path, mark: str) -> None:
    rows = top_of_running_job("-np", "2", tmp_path=tmp_path, mark=mark)
    check_top(rows, ["localhost", "localhost"])
    assert wait_until_gone(mark) == []


FAKE_SMI = """#!/bin/sh
case "$1" in
    --query-compute-apps=*)
        for pid in $(pgrep -f busy.py); do echo "$pid, GPU-5f1e, 1200"; done ;;
    --query-gpu=uuid,utilization.gpu) echo "GPU-5f1e, 37"; echo "GPU-77aa, 0" ;;
    *) echo 0; echo 1 ;;
esac
"""


def test_top_shows_gpu_memory_and_utilisation_where_nvidia_smi_answers(
    tmp_path: Path, mark: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PATH", path)  # dtrain's own (the local ranks' figures are taken there)
        rows = top_of_running_job("-np", "2", tmp_path=tmp_path, mark=mark)
    assert [(r["gpu_mib"], r["gpu_percent"]) for r in rows] == [(1200, 37), (1200, 37)]
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_top_over_ssh(ssh_hosts: TestHosts, tmp_path: Path, mark: str) -> None:
    rows = top_of_running_job(
        "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2", tmp_path=tmp_path, mark=mark
    )
    check_top(rows, ["node1", "node2"])
    assert wait_until_gone(mark) == []


@pytest.mark.parametrize("gpu_mib", [None, 1200])
def test_top_at_80_columns_leaves_room_for_the_last_line(gpu_mib: int | None) -> None:
    from rich.console import Console

    row = {
        "rank": 0, "host": "localhost", "pid": 23029, "state": "running", "cpu_percent": 12.5,
        "rss_mib": 110.6, "gpu_mib": gpu_mib, "gpu_percent": 37, "silent_s": 4.2,
        "last_line": "epoch 3 step 120",
    }  # fmt: skip
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(top_table("20261125-124940-55dd0c", [row]))
    shown = console.export_text()
    assert "epoch 3 step" in shown, shown
    assert ("1.2G 37%" in shown) == (gpu_mib is not None)


def test_ranks_in_the_same_place_group_whatever_their_other_threads() -> None:
    """A data loader's or NCCL's extra thread does not split a group, and of two groups of
    the same size neither is called the odd one."""
    main = {"thread_name": "MainThread", "frames": [frame("all_reduce", 9)]}
    helper = {"thread_name": "Thread-1", "frames": [frame("loader", 30)]}
    other = {"thread_name": "MainThread", "frames": [frame("load", 4)]}
    dumps: dict[int, tuple[str, dict[str, object]]] = {
        0: ("node1", {"threads": [main]}),
        1: ("node1", {"threads": [main, helper]}),
        2: ("node1", {"threads": [other]}),
        3: ("node1", {"threads": [other]}),
    }
    groups = group_stacks(dumps)
    assert [(g.ranks, g.threads) for g in groups] == [((0, 1), (1, 2)), ((2, 3), (1,))]
    assert format_stacks(groups, 4) == [
        "ranks 0-1 of 4 on node1 (main thread, 1-2 threads):",
        "    all_reduce (train.py:9)",
        "",
        "ranks 2-3 of 4 on node1 (main thread):",
        "    load (train.py:4)",
        "",
    ]
