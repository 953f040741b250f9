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
from launcher.core.mpi import launch_parameters, mpi_mapping
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
    assert result.stderr.splitlines()[-2:] == [
        "dtrain: stopped the other 2 ranks",
        "dtrain: rank 2 on localhost failed (exit code 4); dtrain exits 4",
    ]
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
    at = lines.index("dtrain: last stdout lines of rank 1:")
    assert lines[at + 1 : at + 3] == ["    step 1", "    step 2"]


def test_rank_killed_by_signal_under_mpi(mark: str) -> None:
    script = "if [ $OMPI_COMM_WORLD_RANK = 1 ]; then kill -KILL $$; fi; sleep 300"
    result = run_dtrain(
        "run", "--mpi", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 137
    assert (  # (the line is broken between words to fit 80 columns)
        "rank 1 on localhost failed (killed by SIGKILL: out of memory? see dmesg on localhost)"
        in " ".join(result.stderr.split())
    )


def test_dry_run_prints_the_mpirun_command(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")  # a dry run checks the script here, as a run does
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
        cwd=tmp_path,
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
    # Open MPI's daemons fork on their own thread (a pool's would lose a rank that ends at once)
    assert "--prtemca odls_base_max_threads 0 " in " ".join(argv)


def test_a_users_own_fork_threads_setting_is_kept() -> None:
    """Where the user sets ``odls_base_max_threads`` (in ``--mpirun-args`` or as
    ``PRTE_MCA_odls_base_max_threads``), dtrain adds none of its own."""
    assert launch_parameters({}, "") == {"odls_base_max_threads": "0"}
    assert launch_parameters({"PRTE_MCA_odls_base_max_threads": "4"}, "") == {}
    given = run_dtrain(
        "run", "--mpi", "--dry-run", "--json", "-np", "2",
        "--mpirun-args", "--prtemca odls_base_max_threads 4", "true",
    )  # fmt: skip
    assert given.returncode == 0, given.stderr
    joined = " ".join(json.loads(given.stdout)["mpirun"])
    assert joined.count("odls_base_max_threads") == 1 and "odls_base_max_threads 4" in joined


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
        result = run_dtrain("run", "--mpi", "--dry-run", "-np", "1", "true")
        assert result.returncode == 0, result.stderr
        assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_mpiruns_session_folder_is_the_jobs_own_and_removed_at_its_end(mark: str) -> None:
    """Open MPI's session folder (``ompi.<mpirun's pid>``) is in the launcher's private
    folder, not in /tmp, where one a killed mpirun left fails a later mpirun given the same
    pid ("The PMIx server's listener thread failed to start"), and it goes with the job."""
    script = 'echo "session $PMIX_SERVER_TMPDIR"'
    result = run_dtrain(
        "run", "--mpi", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 0, result.stderr
    folders = {line.split()[-1] for r in (0, 1) for line in tagged(result.stdout, r)}
    assert len(folders) == 1, result.stdout
    folder = Path(folders.pop())
    assert folder.name.startswith("ompi."), folder
    assert folder.parent.name.startswith("dtrain-mpi-"), folder  # the launcher's own
    assert not folder.parent.exists()


def test_session_folders_are_left_to_a_user_who_chose_them(tmp_path: Path, mark: str) -> None:
    script = 'echo "session $PMIX_SERVER_TMPDIR"'
    env = {**child_env(), "PRTE_MCA_prte_tmpdir_base": str(tmp_path)}
    result = run_dtrain(
        "run", "--mpi", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script, env=env
    )
    assert result.returncode == 0, result.stderr
    assert Path(tagged(result.stdout, 0)[0].split()[-1]).parent == tmp_path


@pytest.mark.sshhosts
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mpi_daemons_session_folders_are_the_jobs_and_removed_on_each_host(
    ssh_hosts: TestHosts, mark: str
) -> None:
    """On the other hosts, mpirun's daemons keep their session folders in one of the job's,
    made 0700 by dtrain's agent there and removed when the job ends, even when the launcher
    was killed (the agent sees its lifeline close)."""
    import signal
    import subprocess
    import time

    from tests.conftest import start_dtrain

    script = 'echo "session $PMIX_SERVER_TMPDIR"; stat -c %a "${PMIX_SERVER_TMPDIR%/*}"'
    common = ["run", "--mpi", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2"]
    marked = ["-x", f"DTRAIN_TEST_MARK={mark}"]
    result = run_dtrain(*common, *marked, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    for r in (0, 1):
        prefix = f"[{r}@node{r + 1}] "
        lines = [x[len(prefix) :] for x in result.stdout.splitlines() if x.startswith(prefix)]
        assert len(lines) == 2, result.stdout
        folder = Path(lines[0].split()[-1]).parent
        assert folder.name.startswith("dtrain-prte-") and lines[1] == "700", lines
        ssh = subprocess.run([*ssh_hosts.ssh_command, "node2", f"test -e {folder}"], timeout=30)
        assert ssh.returncode == 1, f"{folder} is left"
    # the launcher SIGKILLed: each host's agent removes it when its lifeline closes
    running = start_dtrain(*common, *marked, "sh", "-c", f"{script}; exec sleep 300")
    try:
        assert running.stdout is not None
        first = running.stdout.readline()
        folder = Path(first.split()[-1]).parent
        assert folder.name.startswith("dtrain-prte-"), first
        running.send_signal(signal.SIGKILL)
        running.wait(timeout=30)
        deadline = time.monotonic() + 60
        while (
            subprocess.run(
                [*ssh_hosts.ssh_command, "node2", f"test -e {folder}"], timeout=30
            ).returncode
            == 0
        ):
            assert time.monotonic() < deadline, f"{folder} is left on node2"
            time.sleep(0.5)
    finally:
        running.kill()
        running.wait()
        wait_until_gone(mark)


@pytest.mark.sshhosts
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_that_end_at_once_end_the_job(ssh_hosts: TestHosts, mark: str) -> None:
    """16 ranks on 2 hosts that end as soon as they start: each job ends.  (Open MPI 5.0's
    daemons, forking on a thread pool, lost such a rank in about 12 runs of 20: mpirun then
    waited forever, its job done.  dtrain has them fork on their event thread.)"""
    import subprocess

    for attempt in range(3):
        try:
            result = run_dtrain(
                "run", "--mpi", "--ssh-config", str(ssh_hosts.ssh_config),
                "-np", "16", "-H", "node1:8,node2:8", "-x", f"DTRAIN_TEST_MARK={mark}",
                "sh", "-c", "exit 0", timeout=40,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"run {attempt + 1} of 3: mpirun did not end after its 16 ranks had")
        assert result.returncode == 0, result.stderr


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
        ({"a": 4}, {"a": 2}, "slot", ({"a": 2}, "slot", True, None)),  # 4 ranks, 2 cores
        ({"a": 2}, {"a": 8}, "slot", ({"a": 8}, "slot", False, None)),  # room for spawn
        ({"a": 4, "b": 2}, {"a": 4, "b": 4}, "slot", ({"a": 4, "b": 4}, "slot", False, None)),
        ({"a": 2, "b": 1}, {"a": 4, "b": 4}, "node", ({"a": 4, "b": 4}, "node", False, None)),
        # K on every host (--nproc-per-node, ppr) with slots to spare: dealt by node, numbered
        # by slot; ppr would cap what MPI_Comm_spawn starts at K a host too
        (
            {"a": 2, "b": 2},
            {"a": 4, "b": 4},
            "slot",
            ({"a": 4, "b": 4}, "node", False, "slot"),
        ),
        ({"a": 2, "b": 1}, {"a": 4, "b": 4}, "slot", ({"a": 4, "b": 4}, "node", False, "slot")),
        ({"a": 3, "b": 3}, {"a": 2, "b": 2}, "slot", ({"a": 2, "b": 2}, "ppr:3:node", True, None)),
        ({"a": 3, "b": 1}, {"a": 2, "b": 2}, "slot", ({"a": 3, "b": 1}, "slot", False, None)),
    ],
)
def test_open_mpi_gets_the_real_slots_and_dtrains_placement(
    placed: dict[str, int], real: dict[str, int], map_by: str, expected: tuple[object, ...]
) -> None:
    mapping = mpi_mapping(placed, real, map_by)
    assert (mapping.slots, mapping.map_by, mapping.oversubscribe, mapping.rank_by) == expected


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


def test_mpiruns_own_lines_are_nobodys_rank_in_json() -> None:
    import io

    from launcher.view.lineviews import JsonLinesView

    out = io.StringIO()
    specs = {r: LaunchSpec(r, Host("h"), r, (), {}) for r in range(2)}
    mpirun = LaunchSpec(0, Host("h"), 0, (), {}, label="mpirun")
    MpiOutput(JsonLinesView(out), specs, mpirun).show(
        mpirun, "stderr", [b"[h:1] plm:ssh: Warning", b"[1,0]<stderr>: rank zero says"]
    )
    shown = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(o["rank"], o.get("label"), o["text"]) for o in shown] == [
        (None, "mpirun", "[h:1] plm:ssh: Warning"),
        (0, None, "rank zero says"),
    ]


def job_pids(job: str) -> list[int]:
    """Processes whose environment has ``DTRAIN_JOB_ID=job`` (on every test host)."""
    needle = f"DTRAIN_JOB_ID={job}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def agent_on(host: str) -> list[int]:
    """dtrain's agents on a test host."""
    from tests.testhosts import processes_in

    found = []
    for pid in processes_in(host):
        try:
            if b"dtrain-remote" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.sshhosts
def test_a_hosts_agent_kills_what_is_left_of_an_mpi_job_when_closed(
    ssh_hosts: TestHosts, mark: str
) -> None:
    """After mpirun the launcher waits on no host (it asked each one over a new SSH session,
    0.5 s at best, 4 s and more on a busy machine): each host's agent, told the job when
    mpirun starts, kills what is left of it there when the launcher closes it, and only
    that (not another job's, not another host's)."""
    import subprocess
    import time

    from launcher.remote import agent
    from launcher.transport.agentlink import HostAgent
    from launcher.transport.local import LocalTransport
    from launcher.transport.mpi import MpirunTransport
    from launcher.transport.ssh import connect
    from launcher.transport.sshconfig import SshSettings, load_ssh_config

    ours, other = f"{mark}-ours", f"{mark}-other"
    for job in (ours, other):
        detached = f"DTRAIN_JOB_ID={job} DTRAIN_TEST_MARK={mark} setsid sleep 60 </dev/null"
        subprocess.run(
            [*ssh_hosts.ssh_command, "node2", f"{detached} >/dev/null 2>&1 &"],
            check=True, timeout=30,
        )  # fmt: skip
    settings = SshSettings(config_file=str(ssh_hosts.ssh_config), timeout_s=5)
    agents = {}
    for name in ("node1", "node2"):
        connection = connect(Host(name), settings, load_ssh_config(settings))
        agents[name], _ = HostAgent.open(connection, sys.executable, {"ports": 1}, 15)
    transport = MpirunTransport(LocalTransport({}, 1.0), ours, agents, 1.0)
    try:
        assert len(job_pids(ours)) == 1 and len(job_pids(other)) == 1
        transport.tell_agents(agent.MPI_JOB, ours)
        agents["node1"].close()  # node1 does not see node2's processes
        deadline = time.monotonic() + 15
        while agent_on("node1"):  # it has looked for the job's processes, and exited
            assert time.monotonic() < deadline, "node1's agent did not exit"
            time.sleep(0.05)
        assert len(job_pids(ours)) == 1
        agents["node2"].close()
        deadline = time.monotonic() + 15
        while job_pids(ours):
            assert time.monotonic() < deadline, "the job's process on node2 is still there"
            time.sleep(0.05)
        assert len(job_pids(other)) == 1  # another job's process is left alone
    finally:
        transport.close()
        for host_agent in agents.values():
            host_agent.close()
            host_agent.connection.close()
        for pid in job_pids(other):
            os.kill(pid, 9)


def test_the_agent_ends_mpiruns_daemon_by_its_session_folder(tmp_path: Path) -> None:
    """When the launcher closes it, a host's agent kills what is left of an --mpi job there:
    the ranks (by DTRAIN_JOB_ID) and mpirun's daemon, which only its command line names
    (its session folder: alive, it made the folder again after the agent removed it, and an
    empty one was left in /tmp); not a process that names another job's folder."""
    import subprocess

    from launcher.remote import agent

    ours, theirs = tmp_path / "dtrain-prte-ours", tmp_path / "dtrain-prte-theirs"
    daemons = {
        folder: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(folder)])
        for folder in (ours, theirs)
    }
    try:
        killed = agent.kill_job_processes("no-such-job", 5.0, named=str(ours))["killed"]
        assert killed == [daemons[ours].pid]
        assert daemons[ours].wait(timeout=10) == -9 and daemons[theirs].poll() is None
    finally:
        for daemon in daemons.values():
            daemon.kill()
            daemon.wait()


@pytest.mark.sshhosts
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_host_cut_off_ends_an_mpi_job_after_the_host_timeout(
    ssh_hosts: TestHosts, mark: str
) -> None:
    """--host-timeout holds under --mpi: with node2's link down, the job ends with 255 and
    says which host was lost (mpirun's daemons would wait for it for the whole outage), and
    node2's agent ends the ranks there by itself, cut off as it is."""
    from tests.conftest import start_dtrain, wait_for_pids
    from tests.test_failures import set_link, wait_clean, wait_for_sleepers

    proc = start_dtrain(
        "run", "--mpi", "--ssh-config", str(ssh_hosts.ssh_config), "--host-timeout", "3",
        "--grace", "2", "-H", "node1,node2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "sh", "-c", "sleep 300 & wait",
    )  # fmt: skip
    try:
        wait_for_pids(mark, 2)
        wait_for_sleepers(mark, 2)
        set_link("node2", up=False)
        try:
            _, err = proc.communicate(timeout=45)  # (before: not before the link came back)
            assert wait_until_gone(mark, timeout=30) == []  # node2's ranks too, still cut off
        finally:
            set_link("node2", up=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 255, err
    said = " ".join(err.split())
    assert (
        "rank 1 on node2 failed (no word from the agent on node2 for 3 s: the host is frozen "
        "or cut off)" in said
    ), err
    wait_clean(ssh_hosts, mark, timeout_s=30)  # and mpirun's daemon there, once it is back


# Issue 24: what --mpi promised and did not keep.


def test_mpiruns_own_stderr_line_does_not_take_rank_0s_tag() -> None:
    """mpirun's own lines are shown as [mpirun], a rank's as the rank's, whichever comes first
    (the tag of mpirun's spec, which stands on rank 0, was kept for rank 0's lines)."""
    import io

    from launcher.view.lineviews import LineView

    out, err = io.StringIO(), io.StringIO()
    specs = {r: LaunchSpec(r, Host("h"), r, (), {}) for r in range(2)}
    mpirun = LaunchSpec(0, Host("h"), 0, (), {}, label="mpirun")
    output = MpiOutput(LineView(out, err), specs, mpirun)
    output.show(mpirun, "stderr", [b"[h:1] plm:ssh: Warning", b"[1,0]<stderr>: rank zero says"])
    output.show(mpirun, "stdout", [b"[1,1]<stdout>: one", b"mpirun's own", b"[1,0]<stdout>: zero"])
    assert err.getvalue().splitlines() == [
        "[mpirun]<stderr> [h:1] plm:ssh: Warning",
        "[0]<stderr> rank zero says",
    ]
    assert out.getvalue().splitlines() == ["[1] one", "[mpirun] mpirun's own", "[0] zero"]


def job_lines(jobs: Path, rank: int) -> dict[str, list[str]]:
    """A rank's lines in the (one) job directory under ``jobs``, by stream code (o, e)."""
    found: dict[str, list[str]] = {"o": [], "e": []}
    for log in jobs.glob(f"*/rank.{rank}.log"):
        for line in log.read_text().splitlines():
            _, code, text = line.split(" ", 2)
            found[code].append(text)
    return found


BYES = [f"bye {i}" for i in range(1, 9)]
SAY_BYE = 'for i in 1 2 3 4 5 6 7 8; do echo "bye $i"; echo "err bye $i" >&2; done'
STOP_CASES = {  # how dtrain is stopped, how the ranks end, dtrain's exit code
    "Ctrl-C": (["SIGINT"], "exit 0", 130),
    "SIGTERM": (["SIGTERM"], "exit 0", 143),
    "grace SIGKILL": (["SIGTERM"], 'trap "" TERM INT; sleep 300', 143),  # dtrain's SIGKILL
    "Ctrl-C twice": (["SIGINT", "SIGINT"], 'trap "" TERM INT; sleep 300', 130),  # at once
}


def stop_and_check_logs(case: str, mark: str, jobs: Path, *where: str) -> None:
    """Stop an --mpi job of two ranks as ``case`` says, once both are up; each rank's log
    has every line it printed after, until it ended (by itself, or by dtrain's SIGKILL)."""
    import signal
    import time

    from tests.conftest import start_dtrain

    signals, trap_end, code = STOP_CASES[case]
    proc = start_dtrain(
        "run", "--mpi", *where, "--grace", "2", "--job-dir", str(jobs),
        "-x", f"DTRAIN_TEST_MARK={mark}",
        "sh", "-c", f"trap '{SAY_BYE}; {trap_end}' TERM INT; echo up; sleep 300 & wait",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all(job_lines(jobs, rank)["o"] == ["up"] for rank in range(2)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    for rank in range(2):
        lines = job_lines(jobs, rank)
        assert lines["o"] == ["up", *BYES], (rank, err)
        assert lines["e"] == [f"err {bye}" for bye in BYES], (rank, err)
    assert wait_until_gone(mark) == []


@pytest.mark.parametrize("case", list(STOP_CASES))
def test_lines_ranks_print_while_stopped_reach_their_logs(
    mark: str, tmp_path: Path, case: str
) -> None:
    """A rank's lines printed after dtrain stopped it (its SIGTERM handler's, until its
    SIGKILL) are in its log: dtrain signals the ranks where mpirun started them, and mpirun
    lives on to hand on their output (SIGTERM to mpirun killed the ranks unheard)."""
    stop_and_check_logs(case, mark, tmp_path / "jobs", "-np", "2")


@pytest.mark.sshhosts
@pytest.mark.parametrize("case", ["Ctrl-C", "grace SIGKILL"])
def test_lines_remote_ranks_print_while_stopped_reach_their_logs(
    ssh_hosts: TestHosts, mark: str, tmp_path: Path, case: str
) -> None:
    """The same over SSH: each host's agent signals the ranks mpirun started there."""
    where = ("--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2")
    stop_and_check_logs(case, mark, tmp_path / "jobs", *where)


def test_the_rank_shim_keeps_values_with_spaces_quotes_and_dollars() -> None:
    """The shim exports each rank's own variables as they are (it word-split them)."""
    import subprocess

    from launcher.core.mpi import RANK_SHIM, rank_variables

    odd = "a b  'c' \"d\" $HOME `id` \\ $(true) ;*"
    spec = LaunchSpec(0, Host("h"), 0, (), {"DTRAIN_HOST": odd, "NODE_RANK": "0"})
    code = "import os; print(repr(os.environ['DTRAIN_HOST']), os.environ['NODE_RANK'])"
    env = {**child_env(), **rank_variables([spec]), "OMPI_COMM_WORLD_RANK": "0"}
    shown = subprocess.run(
        ["sh", "-c", RANK_SHIM, "dtrain-rank", sys.executable, "-c", code],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert shown.stdout == f"{odd!r} 0\n", shown.stderr


def test_output_dir_under_mpi_has_each_ranks_own_untagged_lines(tmp_path: Path, mark: str) -> None:
    script = 'echo "out $OMPI_COMM_WORLD_RANK"; echo "err $OMPI_COMM_WORLD_RANK" >&2'
    for option in ("--output-dir", "--output-filename"):
        out = tmp_path / option.strip("-")
        result = run_dtrain(
            "run", "--mpi", "-np", "2", option, str(out), "-x", f"DTRAIN_TEST_MARK={mark}",
            "sh", "-c", script,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        for rank in range(2):
            assert (out / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
            assert (out / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
        assert sorted(p.name for p in out.iterdir()) == ["rank.0", "rank.1"]


def test_dry_run_under_mpi_can_be_pasted_as_shown(tmp_path: Path, mark: str) -> None:
    """The dry run's text runs as printed, in another directory, after dtrain has gone: the
    hostfile comes as a heredoc (a dry run writes no file), the variables as exports."""
    import subprocess

    shown = run_dtrain(
        "run", "--mpi", "--dry-run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "-x", "ODD=a 'b' $c", "sh", "-c", 'echo "hi $RANK of $WORLD_SIZE: $ODD"',
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    pasted = subprocess.run(
        ["sh", "-c", shown.stdout], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env=child_env(),
    )  # fmt: skip
    assert pasted.returncode == 0, (shown.stdout, pasted.stderr)
    assert sorted(pasted.stdout.splitlines()) == [
        "[1,0]<stdout>: hi 0 of 2: a 'b' $c",
        "[1,1]<stdout>: hi 1 of 2: a 'b' $c",
    ]
    assert wait_until_gone(mark) == []
