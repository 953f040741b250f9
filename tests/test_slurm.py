"""dtrain inside a real Slurm allocation (one node: this machine): hosts and slots from the
allocation, ranks started by srun, teardown by Ctrl-C, a failing rank or scancel, with no step
and no process left.  Also the allocation's variables, parsed."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.base.errors import UsageError
from launcher.core.hosts import Host
from launcher.transport.slurm import allocation_from
from tests.conftest import (
    DTRAIN,
    REPO,
    child_env,
    marked_pids,
    run_dtrain,
    wait_for_pids,
    wait_until_gone,
)
from tests.slurmcluster import SlurmCluster
from tests.slurmlocal import OneNodeSlurm, unavailable_reason
from tests.testhosts import processes_in

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("env", "hosts"),
    [
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"},
         [Host("n1", 2), Host("n2", 2), Host("n3", 1)]),
        ({"SLURM_JOB_ID": "7", "SLURM_NODELIST": "a,b", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"},
         [Host("a", 4), Host("b", 4)]),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]"}, [Host("gpu01"), Host("gpu02")]),
    ],
)  # fmt: skip
def test_the_allocation_from_slurms_variables(env: dict[str, str], hosts: list[Host]) -> None:
    allocation = allocation_from(env)
    assert allocation is not None and list(allocation.hosts) == hosts
    assert allocation_from({}) is None


def test_an_allocation_whose_variables_disagree() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(UsageError, match="gives 2 counts for 3 nodes"):
        allocation_from(env)


ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_transport_ssh_takes_the_allocations_hosts_too() -> None:
    """Inside an allocation, --transport ssh changes how ranks start, not where."""
    env = {**child_env(), **ALLOCATION}
    done = run_dtrain("run", "--dry-run", "--transport", "ssh", "true", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        "dtrain: inside Slurm job 7: 4 task(s) on n1:2,n2:2; ranks start over ssh"
    )
    hosts = re.findall(r"^rank (\d) +host (\S+)", done.stdout, re.MULTILINE)
    assert hosts == [("0", "n1"), ("1", "n1"), ("2", "n2"), ("3", "n2")]
    auto = run_dtrain("run", "--dry-run", "true", env=env)
    assert auto.stderr.splitlines()[0].endswith("; ranks start through srun"), auto.stderr
    given = run_dtrain(
        "run", "--dry-run", "--transport", "ssh", "-H", "localhost:1", "true", env=env
    )
    assert "inside Slurm job" not in given.stderr
    assert re.findall(r"^rank \d +host (\S+)", given.stdout, re.MULTILINE) == ["localhost"]


def test_dtrain_hosts_shows_the_allocation() -> None:
    env = {**child_env(), **ALLOCATION, "SLURM_TASKS_PER_NODE": "4,2"}
    done = run_dtrain("hosts", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "dtrain: inside Slurm job 7: 6 task(s) on n1:4,n2:2\n"
    assert [(h["host"], h["slots"]) for h in json.loads(done.stdout)] == [("n1", 4), ("n2", 2)]
    given = run_dtrain("hosts", "--json", "-H", "a:3", env=env)
    assert [(h["host"], h["slots"]) for h in json.loads(given.stdout)] == [("a", 3)]
    bad = run_dtrain("hosts", env={**env, "SLURM_JOB_NODELIST": "n[1-"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("dtrain: error: SLURM_JOB_NODELIST: bad host range 'n[1-'")


@pytest.fixture(scope="module")
def slurm() -> Iterator[OneNodeSlurm]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = OneNodeSlurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def allocated(slurm: OneNodeSlurm, tasks: int) -> Iterator[dict[str, str]]:
    """An allocation (salloc --no-shell), as the environment its shell would have; released
    at the end."""
    out = slurm.run("salloc", "--no-shell", "-N1", f"-n{tasks}", "--job-name=test")
    job_id = next(w for w in out.stderr.split() if w.isdigit())
    env = {**child_env(), "SLURM_CONF": slurm.env()["SLURM_CONF"]}
    env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", SLURM_TASKS_PER_NODE=str(tasks))
    try:
        yield env
    finally:
        slurm.run("scancel", job_id)


def dtrain(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*DTRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=REPO,
    )  # fmt: skip


def test_a_job_inside_an_allocation_runs_through_srun(slurm: OneNodeSlurm, mark: str) -> None:
    code = "import os; print(*(os.environ.get(v) for v in ('RANK', 'WORLD_SIZE', 'SLURM_STEP_ID')))"
    with allocated(slurm, 3) as env:
        proc = dtrain(env, "run", "-x", f"DTRAIN_TEST_MARK={mark}", "python", "-c", code)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert ": 3 task(s) on localhost:3; ranks start through srun" in err
    fields = sorted(line.split()[1:] for line in out.splitlines())
    assert [f[:2] for f in fields] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert all(f[2].isdigit() for f in fields)  # started by srun: inside a Slurm step
    assert slurm.steps() == [] and wait_until_gone(mark) == []


def test_a_failing_rank_ends_the_step(slurm: OneNodeSlurm, mark: str) -> None:
    code = "import os, sys, time; time.sleep(0.3); os.environ['RANK'] == '1' and sys.exit(3)"
    with allocated(slurm, 2) as env:
        proc = dtrain(
            env, "run", "-x", f"DTRAIN_TEST_MARK={mark}", "python", "-c", code + "; time.sleep(60)"
        )
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "stopped the other 1 rank\ndtrain: rank 1 on localhost failed (exit code 3)" in err
    assert slurm.steps() == [] and wait_until_gone(mark) == []


@pytest.mark.parametrize("how", ["ctrl-c", "scancel"])
def test_ctrl_c_and_scancel_leave_nothing(slurm: OneNodeSlurm, mark: str, how: str) -> None:
    with allocated(slurm, 2) as env:
        proc = dtrain(env, "run", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "60")
        wait_for_pids(mark, 2)  # both sleeps run
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            slurm.run("scancel", env["SLURM_JOB_ID"])
        _, err = proc.communicate(timeout=60)
    if how == "ctrl-c":
        assert proc.returncode == 130, err
    else:
        assert proc.returncode != 0
        assert "the srun step on localhost ended (scancel, or the allocation's end)" in " ".join(
            err.split()
        )
    assert wait_until_gone(mark, timeout=15) == []
    assert [s for s in slurm.steps() if "dtrain-agent" in s] == []


def test_transport_slurm_outside_an_allocation_is_refused() -> None:
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_JOB")}
    proc = dtrain(env, "run", "--transport", "slurm", "true")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("dtrain: error: --transport slurm: not inside a Slurm allocation")


# -- on the three-node Slurm of the SSH test hosts (tests/slurmcluster.py) -------------------


@pytest.mark.slurm
@pytest.mark.slow
def test_torch_all_reduce_over_three_slurm_nodes(slurm_cluster: SlurmCluster, mark: str) -> None:
    pytest.importorskip("torch")
    env = slurm_cluster.env(child_env())
    done = subprocess.run(
        ["salloc", "-N3", "-n3", *DTRAIN, "run", "-x", f"DTRAIN_TEST_MARK={mark}",
         "examples/torch_allreduce.py"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert ": 3 task(s) on node1:1,node2:1,node3:1; ranks start through srun" in done.stderr
    for rank in range(3):
        node = f"node{rank + 1}"
        assert f"[{rank}@{node}] rank {rank}/3 (local 0) on {node}: all_reduce sum = 6 ok" in (
            done.stdout
        )
    assert "weights identical on all 3 ranks" in done.stdout
    assert slurm_cluster.steps() == []


@pytest.mark.slurm
def test_a_failing_rank_on_three_slurm_nodes(slurm_cluster: SlurmCluster, mark: str) -> None:
    code = "import os, sys, time; time.sleep(0.5); os.environ['RANK'] == '2' and sys.exit(5)"
    code += "; time.sleep(60)"
    run = [*DTRAIN, "run", "-x", f"DTRAIN_TEST_MARK={mark}", "python", "-c", code]
    done = subprocess.run(
        ["salloc", "-N3", "-n3", *run],
        capture_output=True, text=True, env=slurm_cluster.env(child_env()), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert "stopped the other 2 ranks\ndtrain: rank 2 on node3 failed (exit code 5)" in (
        done.stderr
    )
    assert slurm_cluster.steps() == []


@pytest.mark.slurm
def test_mpi_inside_an_allocation(slurm_cluster: SlurmCluster, mark: str) -> None:
    pytest.importorskip("mpi4py")
    run = [*DTRAIN, "run", "--mpi", "-x", f"DTRAIN_TEST_MARK={mark}"]
    done = subprocess.run(
        ["salloc", "-N2", "-n4", *run, "python", "-m", "mpi4py.bench", "helloworld"],
        capture_output=True, text=True, env=slurm_cluster.env(child_env()), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    hello = sorted(line for line in done.stdout.splitlines() if "Hello, World!" in line)
    assert hello == [
        f"[{r}@node{r // 2 + 1}] Hello, World! I am process {r} of 4 on node{r // 2 + 1}."
        for r in range(4)
    ]
    assert slurm_cluster.steps() == []


@pytest.mark.slurm
@pytest.mark.slow
def test_tf_parameter_servers_inside_an_allocation(
    slurm_cluster: SlurmCluster, mark: str, tmp_path: Path
) -> None:
    pytest.importorskip("tensorflow", reason="needs tensorflow-cpu")
    ps = [*DTRAIN, "ps", "--workers", "2", "--ps", "1", "-x", f"DTRAIN_TEST_MARK={mark}"]
    example = [
        "python",
        "examples/tf_ps_train.py",
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    done = subprocess.run(
        ["salloc", "-N3", "-n3", *ps, *example],
        capture_output=True, text=True, env=slurm_cluster.env(child_env()), cwd=REPO, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test accuracy" in done.stdout
    nodes = {m for m in re.findall(r"^\[\w+@(node\d)\]", done.stdout, re.MULTILINE)}
    assert nodes == {"node1", "node2", "node3"}, done.stdout[-2000:]  # tasks on every node
    assert slurm_cluster.steps() == []


@pytest.mark.slurm
def test_ssh_transport_inside_an_allocation(slurm_cluster: SlurmCluster, mark: str) -> None:
    """``--transport ssh`` inside ``salloc -N3 -n6``: the allocation's nodes and tasks, ranks
    started over SSH (so in no Slurm step)."""
    code = (
        "import os, socket; print(os.environ['RANK'], os.environ['WORLD_SIZE'],"
        " socket.gethostname(), os.environ.get('SLURM_STEP_ID', '-'))"
    )
    ssh = ["--transport", "ssh", "--ssh-config", str(slurm_cluster.hosts.ssh_config)]
    run = [*DTRAIN, "run", *ssh, "-x", f"DTRAIN_TEST_MARK={mark}", "python", "-c", code]
    done = subprocess.run(
        ["salloc", "-N3", "-n6", *run],
        capture_output=True, text=True, env=slurm_cluster.env(child_env()), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ": 6 task(s) on node1:2,node2:2,node3:2; ranks start over ssh" in done.stderr
    rows = sorted(line.split("] ", 1)[1].split() for line in done.stdout.splitlines())
    assert rows == [[str(r), "6", f"node{r // 2 + 1}", "-"] for r in range(6)], done.stdout
    assert slurm_cluster.steps() == []


def until_gone(cluster: SlurmCluster, mark: str) -> None:
    """Nothing of the job anywhere: no marked process, no step or job in squeue, no process
    on any node but its sshd and slurmd."""
    assert wait_until_gone(mark, timeout=30) == []
    cluster.wait_idle(timeout=30)
    assert cluster.steps() == [] and cluster.jobs() == []
    assert {n: cluster.job_processes(n) for n in cluster.names} == {n: [] for n in cluster.names}


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["salloc", "sbatch", "salloc --mpi"])
def test_scancel_on_three_slurm_nodes(
    slurm_cluster: SlurmCluster, mark: str, how: str, tmp_path: Path
) -> None:
    """scancel of the job while dtrain runs six ranks through srun on three nodes (dtrain
    under salloc here, or in the batch script on node1), or under mpirun here, whose daemons
    srun started: nothing is left on any node, and dtrain fails (mpirun exits 0 when it
    loses its daemons)."""
    env = {**slurm_cluster.env(child_env()), "PYTHONPATH": str(REPO)}
    mpi = ["--mpi"] if how.endswith("--mpi") else []
    run = [*DTRAIN, "run", *mpi, "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "120"]
    name = f"scancel-{mark[:8]}"
    if how.startswith("salloc"):
        proc = subprocess.Popen(
            ["salloc", "-N3", "-n6", f"--job-name={name}", *run],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )  # fmt: skip
    else:
        batch = ["sbatch", "-N3", "-n6", f"--job-name={name}", f"--output={tmp_path}/out.txt"]
        slurm_cluster.run([*batch, "--wrap", shlex.join(run)], env=env, check=True, cwd=REPO)
    wait_for_pids(mark, 6)
    nodes = set(slurm_cluster.names)
    # (the first six may all be on node1: mpirun and its watchdog before the ranks elsewhere)
    deadline = time.monotonic() + 30
    while not nodes <= (found := {node_of(slurm_cluster, pid) for pid in marked_pids(mark)}):
        assert time.monotonic() < deadline, f"the job's processes are on {found} only"
        time.sleep(0.1)
    steps = wait_for_steps(slurm_cluster, 4 if mpi else 3)  # the agents' (and mpirun's daemons')
    assert nodes <= {step.split()[1] for step in steps}
    sessions = mpi_session_folders(mark)  # each node's agent removes it, SIGTERMed or not
    assert len(sessions) == (1 if mpi else 0), sessions
    job_id = slurm_cluster.run(["squeue", "-h", "-n", name, "-o", "%i"], check=True).stdout.strip()
    slurm_cluster.run(["scancel", job_id], check=True)
    if how.startswith("salloc"):
        _, err = proc.communicate(timeout=60)
        # salloc, told the job is revoked, may SIGTERM dtrain before it sees the steps end
        assert proc.returncode in (143, 255), err
        if proc.returncode == 255:  # (lines broken to fit 80 columns are joined again)
            assert "ended (scancel, or the allocation's end)" in " ".join(err.split()), err
        if proc.returncode == 255 and mpi:
            assert "stopped the other 5 ranks" in err, err  # (the last line, broken to fit)
            assert "mpirun exited 0); dtrain exits 255" in " ".join(err.split()), err
    until_gone(slurm_cluster, mark)
    assert [folder for folder in sessions if os.path.lexists(folder)] == []


def mpi_session_folders(mark: str) -> set[str]:
    """The session folders of mpirun's daemons that the marked job's mpirun names."""
    found: set[str] = set()
    for pid in marked_pids(mark):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            found |= {arg for arg in argv if arg.startswith("/tmp/dtrain-prte-")}
    return found


@pytest.mark.slurm
@pytest.mark.parametrize("mpi", [[], ["--mpi"]], ids=["srun", "mpi"])
def test_ctrl_c_in_a_terminal_on_three_slurm_nodes(
    slurm_cluster: SlurmCluster, mark: str, mpi: list[str]
) -> None:
    """``salloc -N3 dtrain run`` in a terminal (ranks through srun, or mpirun's), then Ctrl-C:
    dtrain stops every rank and exits 130; salloc releases the allocation; nothing is left
    on any node."""
    env = slurm_cluster.env(child_env())
    pid, terminal = pty.fork()
    if pid == 0:  # the child: salloc in a terminal of its own
        os.chdir(REPO)
        run = [*DTRAIN, "run", *mpi, "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "120"]
        os.execvpe("salloc", ["salloc", "-N3", "-n3", *run], env)
    try:
        wait_for_pids(mark, 3)
        os.write(terminal, b"\x03")  # Ctrl-C: SIGINT to the terminal's foreground group
        screen = read_terminal(terminal, timeout=60)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 130, screen
    # (on a loaded machine mpirun may outlast the grace: "(3 with SIGKILL after the 5 s grace)")
    assert re.search(
        r"dtrain: stopped 3 ranks( \(.*\))?\r?\ndtrain: interrupted by SIGINT; dtrain exits 130",
        screen,
    )
    until_gone(slurm_cluster, mark)


def read_terminal(fd: int, timeout: float) -> str:
    """What a terminal shows until its programs have all closed it."""
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        try:
            chunk = os.read(fd, 65536) if ready else b""
        except OSError:  # EIO: no process has the terminal open any more
            break
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


@pytest.mark.slurm
def test_an_allocation_that_is_gone_is_one_line(slurm_cluster: SlurmCluster) -> None:
    """SLURM_JOB_ID of a job that no longer runs (a shell left from an old salloc): srun
    refuses, and dtrain says so in one line (it used to spin forever)."""
    ended = slurm_cluster.run(["salloc", "-N2", "true"], check=True)
    job_id = next(word for word in ended.stderr.split() if word.isdigit())
    env = slurm_cluster.env(child_env())
    env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="node[1-2]", SLURM_TASKS_PER_NODE="1(x2)")
    done = run_dtrain("run", "true", env=env, timeout=60)
    assert done.returncode == 1
    notice, error = done.stderr.splitlines()
    assert notice.endswith("2 task(s) on node1:1,node2:1; ranks start through srun")
    assert error.startswith("dtrain: error: node")
    # srun's reason: "Slurm job N has expired", or "Unable to confirm allocation for job N"
    assert re.search(rf"srun could not start dtrain's agent \(srun: error: .*\b{job_id}\b", error)
    assert f"(hint: check that Slurm job {job_id} still runs (squeue -j {job_id})" in error


def node_of(cluster: SlurmCluster, pid: int) -> str | None:
    return next((name for name in cluster.names if pid in processes_in(name)), None)


def wait_for_steps(cluster: SlurmCluster, count: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(steps := cluster.steps()) < count:
        assert time.monotonic() < deadline, f"expected {count} running steps, have {steps}"
        time.sleep(0.05)
    return steps
