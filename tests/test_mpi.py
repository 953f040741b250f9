"""`dtrain run --mpi`: real Open MPI (from PyPI) and real mpi4py programs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.mpi import mpi_mapping
from launcher.core.outcome import JobResult, RankReport
from launcher.core.plan import Plan, Rank
from launcher.run.mpi import mpi_failure
from launcher.transport.mpi import MpiOutput
from tests.conftest import child_env, py, run_dtrain, tagged, wait_until_gone
from tests.testhosts import TestHosts

MPIRUN = Path(sys.executable).parent / "mpirun"
pytestmark = pytest.mark.skipif(
    not MPIRUN.exists() or shutil.which("python") is None,
    reason="needs Open MPI and mpi4py in this environment (pip install 'dtrain[mpi]')",
)


@pytest.mark.slow
def test_mpi4py_helloworld_has_one_world(mark: str) -> None:
    pytest.importorskip("mpi4py")
    result = run_dtrain(
        "run",
        "--mpi",
        "-np",
        "4",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "-m",
        "mpi4py.bench",
        "helloworld",
    )
    assert result.returncode == 0, result.stderr
    host = os.uname().nodename
    for rank in range(4):
        assert tagged(result.stdout, rank) == [f"Hello, World! I am process {rank} of 4 on {host}."]


@pytest.mark.slow
def test_mpi4py_ringtest(mark: str) -> None:
    pytest.importorskip("mpi4py")
    result = run_dtrain(
        "run",
        "--mpi",
        "-np",
        "3",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "-m",
        "mpi4py.bench",
        "ringtest",
        "-n",
        "1024",
        "-l",
        "10",
    )
    assert result.returncode == 0, result.stderr
    assert any("time for 10 loops" in line for line in tagged(result.stdout, 0))


def test_failing_rank_under_mpi_gives_its_code_and_leaves_nothing(mark: str) -> None:
    script = (
        "echo up; if [ $OMPI_COMM_WORLD_RANK = 2 ]; then echo 'rank two gives up' >&2; exit 4; fi; "
        "sleep 300 & wait"
    )
    result = run_dtrain(
        "run", "--mpi", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 4
    assert (
        "dtrain: rank 2 on localhost failed (exit code 4); stopped the other 2 ranks"
        in result.stderr
    )
    assert "    rank two gives up" in result.stderr.splitlines()
    assert wait_until_gone(mark) == []


def test_mpi_summary_shows_stdout_when_stderr_is_empty(mark: str) -> None:
    script = "if [ $OMPI_COMM_WORLD_RANK = 1 ]; then echo step 1; echo step 2; exit 5; fi; sleep 30"
    result = run_dtrain(
        "run", "--mpi", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 5
    lines = result.stderr.splitlines()
    assert "dtrain: last stdout lines of rank 1:" in lines
    assert lines[-2:] == ["    step 1", "    step 2"]


def test_rank_killed_by_signal_under_mpi(mark: str) -> None:
    script = "if [ $OMPI_COMM_WORLD_RANK = 1 ]; then kill -KILL $$; fi; sleep 300"
    result = run_dtrain(
        "run", "--mpi", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 137
    assert (
        "rank 1 on localhost failed (killed by SIGKILL: out of memory? see dmesg on localhost)"
        in result.stderr
    )


def test_dry_run_prints_the_mpirun_command() -> None:
    result = run_dtrain(
        "run",
        "--mpi",
        "--dry-run",
        "--json",
        "-np",
        "4",
        "-H",
        "localhost:2,localhost2:2",
        "-x",
        "NCCL_DEBUG=INFO",
        "python",
        "train.py",
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    argv = plan["mpirun"]
    assert argv[0].endswith("mpirun") and argv[1:3] == ["-np", "4"]
    assert argv[-2:] == ["python", "train.py"] and argv[-6:-4] == ["sh", "-c"]  # the shim
    # Variables go by name: their values travel in mpirun's environment, not its argv.
    assert argv[argv.index("NCCL_DEBUG") - 1] == "-x" and "PYTHONUNBUFFERED" in argv
    assert not any("=INFO" in a for a in argv)
    assert plan["env"]["NCCL_DEBUG"] == "INFO" and plan["env"]["PYTHONUNBUFFERED"] == "1"
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert plan["hostfile"] == "localhost slots=2\nlocalhost2 slots=2\n"  # the real slots
    assert not any(a.startswith("RANK=") for a in argv)  # per-rank values come from mpirun


def test_mpi4py_without_mpi_is_warned_about() -> None:
    pytest.importorskip("mpi4py")
    result = run_dtrain("run", "-np", "2", "python", "-m", "mpi4py.bench", "helloworld")
    assert result.returncode == 0
    assert "without --mpi every rank is an MPI singleton of size 1" in result.stderr
    assert all("of 1 on" in line for line in result.stdout.splitlines())


@pytest.mark.slow
def test_ring_allreduce_and_data_parallel_examples_under_dtrain_mpi(mark: str) -> None:
    pytest.importorskip("mpi4py")
    ring = run_dtrain(
        "run",
        "--mpi",
        "-np",
        "3",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/mpi_ring_allreduce.py",
        "--check-only",
        "--sizes",
        "1,7,1001",
        "--dtype",
        "all",
    )
    assert ring.returncode == 0, ring.stderr[-2000:]
    assert tagged(ring.stdout, 0) == ["# check: 12 cases on 3 ranks: ok"]
    pytest.importorskip("sklearn")
    training = run_dtrain(
        "run",
        "--mpi",
        "-np",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/mpi_data_parallel.py",
    )
    assert training.returncode == 0, training.stderr[-2000:]
    assert any(
        line.startswith("weights identical on all 2 ranks") for line in tagged(training.stdout, 0)
    )
    accuracy = next(ln for ln in tagged(training.stdout, 0) if ln.startswith("test accuracy"))
    assert float(accuracy.split()[2]) >= 0.9


def test_a_killed_launchers_hostfile_folder_is_removed_by_the_next() -> None:
    import subprocess
    import tempfile

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: as a SIGKILLed launcher's
    stale = Path(tempfile.gettempdir()) / f"dtrain-mpi-{gone.pid}-abc123"
    stale.mkdir()
    (stale / "hostfile").write_text("localhost slots=1\n")
    live = Path(tempfile.gettempdir()) / f"dtrain-mpi-{os.getpid()}-def456"  # a running one's
    live.mkdir()
    try:
        result = run_dtrain("run", "--mpi", "--dry-run", "-np", "1", "python", "x.py")
        assert result.returncode == 0, result.stderr
        assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="zombies are read from /proc")
def test_a_killed_launcher_left_a_zombie_has_its_folder_removed_too(tmp_path: Path) -> None:
    """The one pid check (base/pids): a launcher that was killed but not reaped has ended."""
    import subprocess
    import time

    from launcher.run.mpi import remove_stale_folders

    killed = subprocess.Popen(["true"])  # not reaped until the end: a zombie
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{killed.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.01)
        stale = tmp_path / f"dtrain-mpi-{killed.pid}-abc123"
        live = tmp_path / f"dtrain-mpi-{os.getpid()}-def456"
        for folder in (stale, live):
            folder.mkdir()
            (folder / "hostfile").write_text("localhost slots=1\n")
        remove_stale_folders(tmp_path)
        assert not stale.exists() and live.exists()
    finally:
        killed.wait()


@pytest.mark.parametrize(
    ("placed", "real", "map_by", "expected"),
    [
        ({"a": 4}, {"a": 2}, "slot", ({"a": 2}, "slot", True)),  # 4 ranks, 2 cores: says so
        ({"a": 2}, {"a": 8}, "slot", ({"a": 8}, "slot", False)),  # room left (MPI_Comm_spawn)
        ({"a": 4, "b": 2}, {"a": 4, "b": 4}, "slot", ({"a": 4, "b": 4}, "slot", False)),
        ({"a": 2, "b": 1}, {"a": 4, "b": 4}, "node", ({"a": 4, "b": 4}, "node", False)),
        ({"a": 2, "b": 2}, {"a": 4, "b": 4}, "slot", ({"a": 4, "b": 4}, "ppr:2:node", False)),
        ({"a": 3, "b": 3}, {"a": 2, "b": 2}, "slot", ({"a": 2, "b": 2}, "ppr:3:node", True)),
        ({"a": 3, "b": 1}, {"a": 2, "b": 2}, "slot", ({"a": 3, "b": 1}, "slot", False)),
    ],
)
def test_open_mpi_gets_the_real_slots_and_dtrains_placement(
    placed: dict[str, int], real: dict[str, int], map_by: str, expected: tuple[object, ...]
) -> None:
    mapping = mpi_mapping(placed, real, map_by)
    assert (mapping.slots, mapping.map_by, mapping.oversubscribe) == expected


def test_mpi_ranks_get_the_torch_contract(mark: str) -> None:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "DTRAIN_HOST")
    names += ("MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    code = f"import os; print(*(os.environ.get(v) for v in {names!r}))"
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": "5,6,7"}  # three GPUs seen: bound per rank
    result = run_dtrain(
        "run", "--mpi", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}",
        *py(code), env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        (line,) = tagged(result.stdout, rank)
        fields = line.split()
        assert fields[:6] == [str(rank), "3", str(rank), "3", "0", "localhost"]
        assert fields[6].isdigit() and fields[7] == str(5 + rank)
    assert wait_until_gone(mark) == []


def test_mpirun_options_pass_through() -> None:
    result = run_dtrain(
        "run", "--mpi", "--dry-run", "--json", "-np", "2", "--mca", "btl", "self,tcp",
        "-mca", "pml", "ob1", "--mpirun-args", "--display-map --timeout 60", "--bind-to", "core",
        "--oversubscribe", "true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)["mpirun"]
    joined = " ".join(argv)
    assert "--mca btl self,tcp" in joined and "--mca pml ob1" in joined
    assert "--display-map --timeout 60 sh -c" in joined  # before the rank's shim
    assert "--bind-to core" in joined and "--oversubscribe" in joined


def test_partial_lines_and_nul_bytes_are_split_back_per_rank() -> None:
    shown: list[tuple[int, str, bytes]] = []

    class Sink:
        def show(self, spec: LaunchSpec, stream: str, lines: list[bytes]) -> None:
            shown.extend((spec.rank, stream, line) for line in lines)

        def update(self, state: object) -> None:
            pass

    specs = {r: LaunchSpec(r, Host("h"), r, (), {}) for r in range(4)}
    output = MpiOutput(Sink(), specs, LaunchSpec(-1, Host("h"), 0, (), {}, label="mpirun"))  # type: ignore[arg-type]
    output.show(
        specs[0], "stdout", [b"[1,0]<stderr>: ......[1,3]<stderr>: ....", b"[1,2]<stdout>: a\0b"]
    )
    assert shown == [(0, "stderr", b"......"), (3, "stderr", b"...."), (2, "stdout", b"ab")]


def test_a_rank_and_mpirun_disagreeing_on_the_exit_code_are_both_said() -> None:
    specs = {r: LaunchSpec(r, Host("h"), r, (), {}) for r in range(2)}
    output = MpiOutput(QuietSink(), specs, LaunchSpec(-1, Host("h"), 0, (), {}, label="mpirun"))  # type: ignore[arg-type]
    output.own_lines = ["Process name: [prterun-h-1,1]\n  Exit code:    1"]
    report = RankReport(-1, "mpirun", 213, (), "stderr")
    result = JobResult(exit_code=213, world_size=1, elapsed_s=1.0, failure=report)
    plan = Plan(tuple(Rank(r, Host("h"), r, 0, 2, 2) for r in range(2)))
    fixed = mpi_failure(result, output, plan)
    assert fixed.exit_code == 1 and fixed.failure is not None
    assert (fixed.failure.rank, fixed.failure.cause) == (1, "exit code 1; mpirun exited 213")


class QuietSink:
    def show(self, *args: object) -> None:
        pass

    def update(self, *args: object) -> None:
        pass


def test_mpi_comm_spawn_has_room_with_oversubscribe(mark: str, tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    (tmp_path / "spawn.py").write_text(
        "import sys\nfrom mpi4py import MPI\n"
        "child = MPI.COMM_SELF.Spawn(sys.executable, args=['-c', 'from mpi4py import MPI; "
        "MPI.Comm.Get_parent().Disconnect()'], maxprocs=1)\n"
        "child.Disconnect(); print('spawned', MPI.COMM_WORLD.Get_rank(), flush=True)\n"
    )
    result = run_dtrain(
        "run", "--mpi", "-np", "2", "--oversubscribe", "-x", f"DTRAIN_TEST_MARK={mark}",
        str(tmp_path / "spawn.py"), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(result.stdout.splitlines()) == ["[0] spawned 0", "[1] spawned 1"]


# After mpirun: what it left of a job's ranks (Open MPI sometimes leaves a rank's child when a
# rank fails early) is found by the job's DTRAIN_JOB_ID and killed, here and on remote hosts.


def test_leftovers_of_a_job_are_killed_and_only_theirs(mark: str) -> None:
    import subprocess

    from launcher.transport.mpi import kill_local_mpi_leftovers

    def sleeper(job: str) -> subprocess.Popen[bytes]:
        env = {**child_env(), "DTRAIN_JOB_ID": job, "DTRAIN_TEST_MARK": mark}
        return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)

    ours, other = sleeper(f"{mark}-a"), sleeper(f"{mark}-b")
    try:
        assert kill_local_mpi_leftovers(f"{mark}-a") == [ours.pid]
        assert ours.wait(timeout=10) == -9
        assert other.poll() is None  # another job's process is left alone
    finally:
        other.kill()
        other.wait()


@pytest.mark.sshhosts
def test_leftovers_on_a_remote_host_are_killed(ssh_hosts: TestHosts, mark: str) -> None:
    import subprocess

    from launcher.transport.mpi import kill_remote_mpi_leftovers
    from launcher.transport.ssh import connect
    from launcher.transport.sshconfig import SshSettings, load_ssh_config

    job = f"{mark}-remote"
    detached = f"DTRAIN_JOB_ID={job} DTRAIN_TEST_MARK={mark} setsid sleep 60 </dev/null >/dev/null"
    subprocess.run([*ssh_hosts.ssh_command, "node2", f"{detached} 2>&1 &"], check=True, timeout=30)
    settings = SshSettings(config_file=str(ssh_hosts.ssh_config), timeout_s=5)
    for name, expected in (("node1", 0), ("node2", 1)):  # node1 does not see node2's
        connection = connect(Host(name), settings, load_ssh_config(settings))
        try:
            answer = kill_remote_mpi_leftovers(connection, job, 15)
        finally:
            connection.close()
        assert len(answer.get("killed", [])) == expected, answer
    assert wait_until_gone(mark) == []
