"""Whole-job restarts for real (--max-restarts): processes, the SSH test hosts, the checkpoint
example.  Every rank of a restart first looks for processes of earlier attempts (by their
DTRAIN_RESTART_COUNT) and says how many it saw: a restart may start only once nothing of the
failed attempt runs, leftovers that ignore SIGTERM included."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig, PlacementConfig
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, RankReport
from launcher.core.plan import Plan, Rank
from launcher.core.policy import RestartAfter
from launcher.run.attempt import SURVEY_POLL_S, Finished
from launcher.run.discovery import DISCOVERY_POLL_S, watch_discovery
from launcher.run.job import run_job
from launcher.run.restarts import restart_notice
from tests.conftest import (
    JOBS,
    REPO,
    child_env,
    dtrain_in_process,
    run_dtrain,
    start_dtrain,
    wait_for_pids,
    wait_until_gone,
)
from tests.fakes import FakeClock, FakeProcess, FakeTransport, RecordingFrontend
from tests.test_job import local_survey
from tests.testhosts import SUBNET, TestHosts

pytestmark = pytest.mark.timeout(240)

# Looks for earlier attempts' processes, then (in attempt 0) leaves a child that ignores
# SIGTERM behind and fails as FAIL says: "exit" (code 3) or "kill" (SIGKILL) on rank 1.
# An attempt that fails, and the first, run RUN_S (its other ranks still run when rank 1
# fails or a host is lost); a later attempt that succeeds ends after 0.2 s.
RANK = r"""
import os, signal, subprocess, sys, time
attempt, rank = int(os.environ["DTRAIN_RESTART_COUNT"]), os.environ["RANK"]
mark = "DTRAIN_TEST_MARK=" + os.environ["DTRAIN_TEST_MARK"]
earlier = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        continue
    counts = [int(v.split("=")[1]) for v in env if v.startswith("DTRAIN_RESTART_COUNT=")]
    if mark in env and counts and counts[0] < attempt:
        earlier += 1
print(f"attempt {attempt} rank {rank} of {os.environ['WORLD_SIZE']} on "
      f"{os.uname().nodename}: earlier processes alive {earlier}", flush=True)
ready = os.environ.get("DTRAIN_CHECKPOINT_DIR", "")  # (the job's, on this machine's disk)
try:
    open(os.path.join(ready, f"ready.{attempt}.{rank}"), "w").close()
except OSError:
    ready = ""
failing = attempt < int(os.environ.get("FAIL_ATTEMPTS", "1"))
if failing and rank == "1":
    # every rank of the attempt has said its line before this one fails: on a busy machine
    # a rank still scanning /proc was stopped before it printed (its line never existed)
    deadline = time.time() + 20
    while ready and time.time() < deadline and sum(
        name.startswith(f"ready.{attempt}.") for name in os.listdir(ready)
    ) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"])
    time.sleep(0.5)
    if os.environ["FAIL"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(float(os.environ.get("RUN_S", "1")) if failing or attempt == 0 else 0.2)
"""


def attempts_seen(stdout: str) -> list[tuple[int, str, str, str, int]]:
    """(attempt, rank, world size, host, earlier processes alive) per line of RANK."""
    return [
        (int(m[1]), m[2], m[3], m[4], int(m[5]))
        for m in re.finditer(
            r"attempt (\d+) rank (\d+) of (\d+) on (\S+): earlier processes alive (\d+)", stdout
        )
    ]


def rank_args(mark: str, fail: str = "exit", attempts: int = 1) -> list[str]:
    return [
        "-x", f"DTRAIN_TEST_MARK={mark}", "-x", f"FAIL={fail}", "-x", f"FAIL_ATTEMPTS={attempts}",
        sys.executable, "-c", RANK,
    ]  # fmt: skip


@pytest.mark.parametrize(("fail", "code"), [("exit", "exit code 3"), ("kill", "killed by SIGKILL")])
def test_a_failed_rank_restarts_the_whole_job(mark: str, fail: str, code: str) -> None:
    result = run_dtrain(
        "run", "-np", "3", "--max-restarts", "2", "--restart-delay", "0", "--grace", "0.5",
        *rank_args(mark, fail),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = attempts_seen(result.stdout)
    assert sorted(seen) == [
        (a, str(r), "3", os.uname().nodename, 0) for a in (0, 1) for r in range(3)
    ]
    assert f"dtrain: attempt 0 failed (rank 1 on localhost: {code}); restart 1 of 2 in 0 s" in (
        result.stderr
    )
    assert wait_until_gone(mark) == []


SpentBudget = tuple[subprocess.CompletedProcess[str], str]


@pytest.fixture(scope="module")
def spent_budget() -> Iterator[SpentBudget]:
    """A job whose every attempt fails, until its --max-restarts 2 are spent, and the mark of
    its processes: run once for the tests that read it (its exit, its records, its logs)."""
    mark = uuid.uuid4().hex
    result = run_dtrain(
        "run", "-np", "2", "--max-restarts", "2", "--restart-delay", "0.1", "--grace", "0.5",
        *rank_args(mark, attempts=99),
    )  # fmt: skip
    yield result, mark
    for pid in wait_until_gone(mark):  # (each test says so: none is left)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_budget_spent_ends_with_the_last_attempts_code(spent_budget: SpentBudget) -> None:
    result, mark = spent_budget
    assert result.returncode == 3, result.stderr
    assert [a for a, *_ in attempts_seen(result.stdout) if _[0] == "1"] == [0, 1, 2]
    assert "restart 1 of 2" in result.stderr and "restart 2 of 2" in result.stderr
    assert "restart 3" not in result.stderr
    assert "rank 1 on localhost failed (exit code 3)" in result.stderr
    assert wait_until_gone(mark) == []


def test_backoff_between_attempts_without_a_delay(mark: str) -> None:
    result = run_dtrain(
        "run", "-np", "2", "--max-restarts", "1", "--grace", "0.5", *rank_args(mark)
    )  # (--grace: the leftover that ignores SIGTERM is killed sooner; no --restart-delay)
    assert result.returncode == 0, result.stderr
    assert "restart 1 of 1 in 1 s" in result.stderr  # the first step of the backoff


class WaitLog(FakeClock):
    """The job's fake clock, keeping every wait longer than a restart's survey poll: the
    waits between attempts (the survey's short polls for a signal are not kept).  Those
    wait for a signal to dtrain, which nothing sends here: time jumps at once, without
    the real moment a fake clock gives other threads to post what they have."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if timeout is None or timeout <= SURVEY_POLL_S:
            return super().wait(event, timeout)
        self.waits.append(timeout)
        if not event.is_set():
            self.time += timeout
        return event.is_set()


@pytest.mark.parametrize(
    ("delay_s", "waits"), [(None, [1, 2, 4, 8, 16, 30]), (0.5, [0.5] * 6), (600.0, [600] * 6)]
)
def test_the_wait_between_attempts_is_the_backoff_it_announces(
    tmp_path: Path, delay_s: float | None, waits: list[float]
) -> None:
    """Not only the restart line: the wait itself, on the job's clock (1 s, doubling up to 30
    s; or --restart-delay), the same as each line announces."""
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(np=2),
        job_dir=str(tmp_path),
        max_restarts=6,
        restart_delay_s=delay_s,
    )
    clock = WaitLog()
    transport = FakeTransport({0: ({}, None, False), 1: ({}, 3, False)}, clock)
    frontend = RecordingFrontend()
    outcome = run_job(
        config, {"PATH": "/usr/bin"}, frontend, survey=local_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 3
    assert clock.waits == waits
    announced = [float(n.rsplit(" in ", 1)[1].removesuffix(" s")) for n in frontend.notices
                 if "; restart " in n]  # fmt: skip
    assert announced == waits


def test_the_restart_line_puts_a_colon_before_the_cause() -> None:
    """As the other summaries: 'rank 2 on h3: the connection to h3 was lost'."""
    lost = RankReport(2, "h3", 255, (), "stderr", cause="the connection to h3 was lost")
    killed = RankReport(1, "h2", -signal.SIGKILL, (), "stderr")
    lines = [
        restart_notice(JobResult(255, 4, 1.0, failure), RestartAfter(1, 2.0), 3, 0)
        for failure in (lost, killed, None)
    ]
    assert lines == [
        "dtrain: attempt 0 failed (rank 2 on h3: the connection to h3 was lost); restart 1 of 3 "
        "in 2 s",
        "dtrain: attempt 0 failed (rank 1 on h2: killed by SIGKILL); restart 1 of 3 in 2 s",
        "dtrain: attempt 0 failed (exit code 255); restart 1 of 3 in 2 s",
    ]


class Polls:
    """The discovery watcher's clock: each wait is one poll, at once; after ``count`` polls
    the watch ends (as when its attempt ends), and ``over`` is set."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.over = threading.Event()

    def now(self) -> float:
        return 0.0

    def wall(self) -> float:
        return 0.0

    def take(self, inbox: object, timeout: float | None) -> None:
        raise AssertionError("the watcher takes nothing")

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if self.left == 0:
            self.over.set()
            return True
        self.left -= 1
        return False

    def sleep(self, seconds: float) -> None:
        raise AssertionError("the watcher waits on its event")


class Rescales:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def rescale(self, reason: str) -> None:
        self.reasons.append(reason)


@pytest.mark.parametrize(
    ("cooldown_s", "said"),
    [
        (None, "dtrain: h3 is listed again but stays out after its failure; "
               "--blacklist-cooldown lets it back"),
        (60.0, "dtrain: h3 is listed again but stays out after its failure "
               "(--blacklist-cooldown 60 s: it rejoins at the job's next start after that)"),
    ],
)  # fmt: skip
def test_a_failed_host_listed_again_stays_out_and_says_so_once(
    tmp_path: Path, cooldown_s: float | None, said: str
) -> None:
    """The discovery script lists h3 again after its failure: the running attempt is not
    stopped for it (it stays out, as horovodrun's blacklist), and the run says so, once, not
    at every poll."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho h1:1\necho h2:1\necho h3:1\n")
    script.chmod(0o755)
    placement = PlacementConfig(
        host_discovery_script=str(script), min_np=1, blacklist_cooldown_s=cooldown_s
    )
    ranks = tuple(Rank(i, Host(name), 0, i, 1, 2) for i, name in enumerate(["h1", "h2"]))
    clock, supervisor, notices = Polls(4), Rescales(), list[str]()
    plan = Plan(ranks)
    watching = watch_discovery(supervisor, plan, placement, {"h3"}, clock, notices.append)  # type: ignore[arg-type]
    assert clock.over.wait(60), "the watcher never polled four times"
    watching.set()
    assert notices == [said]
    assert supervisor.reasons == []  # h3 left out: nothing to grow into


def test_ctrl_c_never_restarts(mark: str) -> None:
    env = {**child_env(), "RUN_S": "60"}
    proc = start_dtrain(
        "run", "-np", "2", "--max-restarts", "3", "--restart-delay", "0",
        *rank_args(mark, attempts=0), env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    started = [proc.stdout.readline() for _ in range(2)]  # both ranks run
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "restart" not in err
    assert [a for a, *_ in attempts_seen("".join(started) + out)] == [0, 0]
    assert wait_until_gone(mark) == []


def test_ctrl_c_while_waiting_to_restart_ends_the_job(mark: str) -> None:
    proc = start_dtrain(
        "run", "-np", "2", "--max-restarts", "3", "--restart-delay", "30", "--grace", "0.5",
        *rank_args(mark),
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while "restart 1 of 3" not in (line := proc.stderr.readline()):
        assert line and time.monotonic() < deadline, "no restart announced"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 3  # the attempt that ran: its failure
    assert [a for a, *_ in attempts_seen(out)] == [0, 0]


def test_a_discovery_script_changes_the_hosts_between_attempts(tmp_path: Path, mark: str) -> None:
    script = tmp_path / "discover.sh"
    calls = tmp_path / "calls"
    script.write_text(
        f"#!/bin/sh\necho x >> {calls}\n"
        f'if [ "$(wc -l < {calls})" -eq 1 ]; then echo localhost:3; else echo localhost:2; fi\n'
    )
    script.chmod(0o755)
    result = run_dtrain(
        "run", "--host-discovery-script", str(script), "--max-restarts", "1",
        "--restart-delay", "0", "--grace", "0.5", *rank_args(mark),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sizes = {(a, size) for a, _, size, _, _ in attempts_seen(result.stdout)}
    assert sizes == {(0, "3"), (1, "2")}  # the world shrank with the hosts the script gave


@pytest.mark.slow
def test_the_checkpoint_example_resumes_with_the_same_accuracy(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    example = str(REPO / "examples" / "torch_ddp_checkpoint.py")
    common = ["run", "-np", "2", "--max-restarts", "2", "--restart-delay", "0"]
    started = [  # side by side: one job's waits (its ranks' start, the restart) overlap the other's
        start_dtrain(*common, "--checkpoint-dir", str(tmp_path / "a"), example),
        start_dtrain(
            *common, "--checkpoint-dir", str(tmp_path / "b"), example, "--crash-at-step", "70"
        ),
    ]
    try:
        outputs = [proc.communicate(timeout=200) for proc in started]
        clean, crashed = (
            subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(started, outputs, strict=True)
        )
    finally:
        for proc in started:
            proc.kill()
            proc.communicate()
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "attempt 1: resuming from step 60 (step-000060.pt)" in crashed.stdout
    assert "restart 1 of 2" in crashed.stderr and "restart" not in clean.stderr
    accuracy = [
        float(re.findall(r"test accuracy: ([\d.]+)", r.stdout)[0]) for r in (clean, crashed)
    ]
    assert accuracy[0] >= 0.9
    assert abs(accuracy[0] - accuracy[1]) <= 0.01, accuracy  # the README's tolerance
    # The figures the docs give are these runs' (the same whatever the CPU's vector
    # instructions: tried with ATEN_CPU_CAPABILITY=default, avx2 and avx512).
    text = " ".join((REPO / "docs" / "fault-tolerance.md").read_text().split())
    told = re.search(
        r"ends with test accuracy ([\d.]+), the same as the undisturbed run \(([\d.]+)\)", text
    )
    assert told, "docs/fault-tolerance.md no longer gives the checkpoint example's figures"
    assert accuracy == [float(told[2]), float(told[1])]
    listed = " ".join((REPO / "docs" / "examples.md").read_text().split())
    assert f"test accuracy {accuracy[1]:.4f}, the same as without the crash" in listed


@pytest.mark.sshhosts
@pytest.mark.parametrize("min_np", [None, "2"])
def test_a_lost_host_is_left_out(ssh_hosts: TestHosts, mark: str, min_np: str | None) -> None:
    from tests.test_failures import kill_host

    elastic = ["--min-np", min_np] if min_np else []
    # (RUN_S by -x: a remote rank gets dtrain's variables and -x's, not dtrain's environment)
    proc = start_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3", "-np", "3",
        "--max-restarts", "1", "--restart-delay", "0", "--host-timeout", "5", "--grace", "1",
        *elastic, "-x", "RUN_S=8", *rank_args(mark, attempts=0),
    )  # fmt: skip
    try:
        wait_for_pids(mark, 3)
        kill_host(proc, ssh_hosts, mark)
        out, err = proc.communicate(timeout=120)
    finally:
        ssh_hosts.stop()  # node2 was killed: the next test gets fresh hosts
    assert "dtrain: leaving out node2 (failed)" in err, err
    if min_np:
        assert proc.returncode == 0, err
        second = sorted((r, size, host) for a, r, size, host, _ in attempts_seen(out) if a == 1)
        assert second == [("0", "2", "node1"), ("1", "2", "node3")]
    else:
        assert proc.returncode != 0
        assert "dtrain: cannot restart: -np 3 is more than the 2 slots of node1:1, node3:1" in err
    assert wait_until_gone(mark) == []


@pytest.mark.slow
def test_a_failed_ps_task_restarts_the_parameter_server_job(tmp_path: Path, mark: str) -> None:
    (tmp_path / "task.py").write_text(
        "import os, sys, time\n"
        "role, attempt = os.environ['DTRAIN_ROLE'], os.environ['DTRAIN_RESTART_COUNT']\n"
        "print(role, 'attempt', attempt, flush=True)\n"
        "if role == 'ps' and attempt == '0':\n"
        "    time.sleep(0.5); sys.exit(1)\n"
        "if role == 'chief':  # (in attempt 0, running still when the ps task fails)\n"
        "    time.sleep(3 if attempt == '0' else 0.5); sys.exit(0)\n"
        "time.sleep(60)\n"
    )
    result = run_dtrain(
        "ps", "--workers", "2", "--ps", "1", "--max-restarts", "1", "--restart-delay", "0",
        "--grace", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "task.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "attempt 0 failed (rank 3 on localhost: exit code 1); restart 1 of 1" in result.stderr
    assert "[chief] chief attempt 1" in result.stdout
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_a_remote_rank_restarts_once_its_leftovers_are_gone(
    ssh_hosts: TestHosts, mark: str
) -> None:
    result = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2", "--max-restarts",
        "1", "--restart-delay", "0", "--grace", "1", *rank_args(mark, "kill"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = sorted(attempts_seen(result.stdout))
    assert seen == [(a, str(r), "2", f"node{r + 1}", 0) for a in (0, 1) for r in range(2)]
    assert "rank 1 on node2: killed by SIGKILL" in result.stderr


def test_each_attempt_is_recorded_and_its_logs_selectable(spent_budget: SpentBudget) -> None:
    result, mark = spent_budget
    assert result.returncode == 3
    assert wait_until_gone(mark) == []
    job = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    status = json.loads((JOBS / job / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 3)  # not "restarting"
    attempts = json.loads((JOBS / job / "attempts.json").read_text())
    assert [(a["attempt"], a["exit_code"], a["failure"]["rank"]) for a in attempts] == [
        (0, 3, 1), (1, 3, 1), (2, 3, 1),
    ]  # fmt: skip
    for number in range(3):
        logs = dtrain_in_process("logs", job, "--attempt", str(number))
        assert [a for a, *_ in attempts_seen(logs.stdout)] == [number, number], logs.stdout
    missing = dtrain_in_process("logs", job, "--attempt", "3")
    assert missing.returncode == 2 and "has attempts 0 to 2" in missing.stderr


def test_dtrain_stop_between_attempts_ends_the_job(mark: str, tmp_path: Path) -> None:
    proc = start_dtrain(
        "run", "-np", "2", "--max-restarts", "3", "--restart-delay", "30", "--grace", "0.5",
        *rank_args(mark, attempts=99),
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while "restart 1 of 3" not in (line := proc.stderr.readline()):
        assert line and time.monotonic() < deadline, "no restart announced"
    stopped = run_dtrain("stop")
    assert stopped.returncode == 0, stopped.stderr
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "no restart" in err
    assert wait_until_gone(mark) == []


def test_output_dir_keeps_every_attempt(mark: str, tmp_path: Path) -> None:
    result = run_dtrain(
        "run", "-np", "2", "--max-restarts", "1", "--restart-delay", "0", "--grace", "0.5",
        "--output-dir", str(tmp_path / "out"), *rank_args(mark),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    kept = (tmp_path / "out" / "rank.1" / "stdout").read_text()
    assert "attempt 0 rank 1" in kept and "attempt 1 rank 1" in kept


def test_timeout_is_for_the_whole_job_not_each_attempt(mark: str) -> None:
    result = run_dtrain(
        "run", "--max-restarts", "20", "--restart-delay", "0", "--timeout", "4", "-np", "1",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 1; exit 1",
    )  # fmt: skip
    assert result.returncode == 124, result.stderr[-2000:]
    assert "the job ran longer than --timeout 4 s" in result.stderr
    attempts = result.stderr.count("failed (rank 0 on localhost: exit code 1)")
    assert 1 <= attempts < 20 and "restart 20 of 20" not in result.stderr
    job = JOBS / result.stderr.split("dtrain: job ", 1)[1].split()[0]  # its first attempt's
    records = json.loads((job / "attempts.json").read_text())
    started = json.loads((job / "status.json").read_text())["started"]
    assert started <= records[0]["started"] < records[1]["started"]
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_a_host_unreachable_at_the_restart_is_left_out(ssh_hosts: TestHosts, mark: str) -> None:
    from tests.test_failures import set_link

    proc = start_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3", "-np", "3",
        "--min-np", "2", "--max-restarts", "1", "--restart-delay", "2", "--ssh-timeout", "3",
        "--grace", "1", *rank_args(mark),
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        err = ""
        while "restart 1 of 1" not in err:
            line = proc.stderr.readline()
            assert line, err
            err += line
        set_link("node3", up=False)  # node3 drops off the network before the restart
        out, rest = proc.communicate(timeout=120)
    finally:
        set_link("node3", up=True)
    err += rest
    assert proc.returncode == 0, err
    assert (
        f"dtrain: leaving out node3 (unreachable: node3 ({SUBNET}.13): no answer on port 22" in err
    )
    second = sorted((r, size, host) for a, r, size, host, _ in attempts_seen(out) if a == 1)
    assert second == [("0", "2", "node1"), ("1", "2", "node2")]
    assert wait_until_gone(mark) == []


def test_logs_of_a_detached_job_tell_its_attempts(mark: str) -> None:
    started = run_dtrain(
        "run", "--detach", "-np", "2", "--max-restarts", "1", "--restart-delay", "0",
        "--grace", "0.5", *rank_args(mark),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    job = started.stdout.split()[0]
    followed = run_dtrain("logs", "-f", job)
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    failed = lines.index("dtrain: attempt 0 failed (rank 1 on localhost: exit code 3)")
    restart = lines.index("dtrain: restart 1: 2 ranks on localhost")
    first = [i for i, ln in enumerate(lines) if re.search(r"\] attempt 0 rank", ln)]
    second = [i for i, ln in enumerate(lines) if re.search(r"\] attempt 1 rank", ln)]
    assert len(first) == len(second) == 2
    assert max(first) < failed < restart < min(second)  # told in the order it happened
    assert wait_until_gone(mark) == []


def test_more_slots_from_the_discovery_script_grow_a_running_job(tmp_path: Path, mark: str) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    program = (
        "import os, time\n"
        "attempt = os.environ['DTRAIN_RESTART_COUNT']\n"
        "print('attempt', attempt, 'rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " flush=True)\n"
        "time.sleep(60 if attempt == '0' else 0.5)\n"
    )
    proc = start_dtrain(
        "run", "--host-discovery-script", str(script), "--max-restarts", "1", "--min-np", "1",
        "--max-np", "3", "--restart-delay", "0", "--grace", "1",
        "-x", f"DTRAIN_TEST_MARK={mark}", sys.executable, "-c", program,
    )  # fmt: skip
    assert proc.stdout is not None
    first = sorted(proc.stdout.readline().split("] ", 1)[1].strip() for _ in range(2))
    assert first == ["attempt 0 rank 0 of 2", "attempt 0 rank 1 of 2"]
    hosts.write_text("localhost:3\n")  # a third slot while the job runs
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (
        "dtrain: the --host-discovery-script gives more slots: 3 ranks fit, 2 run: "
        "starting again on its hosts (not counted as a restart)"
    ) in err
    second = sorted(line.split("] ", 1)[1] for line in out.splitlines() if "attempt 1" in line)
    assert second == [f"attempt 1 rank {r} of 3" for r in range(3)]
    assert wait_until_gone(mark) == []


class HostsChangeWhileRunning(FakeTransport):
    """Attempt 0's ranks run until stopped, and once all ``ranks`` of them started the hosts
    file says ``then``; the ranks of later attempts end at once, with success."""

    def __init__(self, clock: FakeClock, hosts: Path, then: str, ranks: int) -> None:
        super().__init__({}, clock)
        self.hosts, self.then, self.ranks = hosts, then, ranks

    def start(self, spec: LaunchSpec) -> FakeProcess:
        first = spec.env["DTRAIN_RESTART_COUNT"] == "0"
        self.scripts = {spec.rank: ({}, None if first else 0, False)}
        process = super().start(spec)
        if first and len(self.history) == self.ranks:
            self.hosts.write_text(self.then)  # a slot less while the job runs
        return process


def test_a_discovery_script_change_restarts_without_max_restarts(tmp_path: Path) -> None:
    """A host change is not counted as a restart: it starts the job again even with
    --max-restarts 0 (before, the attempt was stopped and dtrain exited 1 without a word).
    On the job's clock and a fake transport: the script's polls, every few seconds, take no
    time (the real path: test_more_slots_from_the_discovery_script_grow_a_running_job)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(host_discovery_script=str(script)),
        job_dir=str(tmp_path / "jobs"),
        grace_s=1,
    )
    assert config.max_restarts == 0
    clock = FakeClock()
    transport = HostsChangeWhileRunning(clock, hosts, "localhost:1\n", ranks=2)
    frontend = RecordingFrontend()
    began = clock.now()
    outcome = run_job(
        config, {"PATH": "/usr/bin"}, frontend, survey=local_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 0, frontend.notices
    assert clock.now() - began >= DISCOVERY_POLL_S  # the script's poll, on the job's clock
    assert (
        "dtrain: the --host-discovery-script gives fewer slots on localhost (1 for 2 ranks): "
        "starting again on its hosts (not counted as a restart)"
    ) in frontend.notices
    runs = [
        (p.spec.env["DTRAIN_RESTART_COUNT"], p.spec.env["WORLD_SIZE"]) for p in transport.history
    ]
    assert runs == [("0", "2"), ("0", "2"), ("1", "1")]  # attempt 1 of 1, once
    assert [p.signals for p in transport.history[:2]] == [[signal.SIGTERM]] * 2  # stopped...
    assert all(p.exited.is_set() for p in transport.history)  # ...and none left running


def test_a_failed_chief_restarts_the_parameter_server_job(tmp_path: Path, mark: str) -> None:
    (tmp_path / "task.py").write_text(
        "import os, sys, time\n"
        "role, attempt = os.environ['DTRAIN_ROLE'], os.environ['DTRAIN_RESTART_COUNT']\n"
        "print(role, 'attempt', attempt, flush=True)\n"
        "if role == 'chief':\n"
        "    time.sleep(1); sys.exit(7 if attempt == '0' else 0)\n"
        "time.sleep(60)\n"
    )
    result = run_dtrain(
        "ps", "--workers", "2", "--ps", "1", "--max-restarts", "1", "--restart-delay", "0",
        "--grace", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "task.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "attempt 0 failed (rank 0 on localhost: exit code 7); restart 1 of 1" in result.stderr
    for role in ("[chief] chief", "[worker0] worker", "[worker1] worker", "[ps0] ps"):
        assert f"{role} attempt 1" in result.stdout, result.stdout
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_a_discovery_script_removes_a_host_and_adds_it_back(
    ssh_hosts: TestHosts, tmp_path: Path, mark: str
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:1\nnode2:1\nnode3:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    # attempts 0 and 1 run until the hosts change; attempt 2 ends by itself
    program = RANK.replace(
        'time.sleep(float(os.environ.get("RUN_S", "1")) if failing or attempt == 0 else 0.2)',
        "time.sleep(60 if attempt < 2 else 0.5)",
    )
    proc = start_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "--host-discovery-script", str(script),
        "--min-np", "2", "--max-np", "3", "--max-restarts", "1", "--restart-delay", "0",
        "--grace", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "-x", "FAIL=exit",
        "-x", "FAIL_ATTEMPTS=0", sys.executable, "-c", program,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = ""
    for expected in (3, 2):  # every rank of the attempt runs: change the hosts
        while len([a for a in attempts_seen(seen) if a[0] == 3 - expected]) < expected:
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        hosts.write_text("node1:1\nnode3:1\n" if expected == 3 else "node1:1\nnode2:1\nnode3:1\n")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    runs = sorted((a, r, size, host) for a, r, size, host, _ in attempts_seen(seen + out))
    assert runs == [
        (0, "0", "3", "node1"), (0, "1", "3", "node2"), (0, "2", "3", "node3"),
        (1, "0", "2", "node1"), (1, "1", "2", "node3"),
        (2, "0", "3", "node1"), (2, "1", "3", "node2"), (2, "2", "3", "node3"),
    ]  # fmt: skip
    assert all(earlier == 0 for *_, earlier in attempts_seen(seen + out))  # none overlapped
    assert "restart 1 of 1" not in err  # host changes are not counted as restarts
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_ctrl_c_while_a_restart_connects_ends_the_job_at_once(
    ssh_hosts: TestHosts, mark: str
) -> None:
    from tests.test_failures import set_link

    proc = start_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2", "-np", "2",
        "--max-restarts", "1", "--restart-delay", "1", "--ssh-timeout", "30", "--grace", "1",
        *rank_args(mark),
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        err = ""
        while "restart 1 of 1" not in err:
            line = proc.stderr.readline()
            assert line, err
            err += line
        set_link("node2", up=False)  # the restart's connection to node2 hangs until 30 s
        time.sleep(3)  # the delay is over: the restart is connecting
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        took_s = time.monotonic() - signalled
    finally:
        set_link("node2", up=True)
    err += rest
    assert took_s < 10, err  # not the 30 s of --ssh-timeout
    assert proc.returncode == 3, err  # the attempt that ran: its failure
    assert "signalled while the restart was being prepared" in err
    assert "leaving out node2" not in err  # a signal is no reason to leave a host out
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
@pytest.mark.slow
def test_a_partitioned_host_is_left_out(ssh_hosts: TestHosts, mark: str) -> None:
    from tests.test_failures import set_link

    proc = start_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3", "-np", "3",
        "--min-np", "2", "--max-restarts", "1", "--restart-delay", "0", "--host-timeout", "5",
        "--grace", "1", "-x", "RUN_S=20", *rank_args(mark, attempts=0),
    )  # fmt: skip
    try:
        wait_for_pids(mark, 3)
        set_link("node2", up=False)  # node2's cable is pulled: no FIN, no RST, just silence
        assert proc.stderr is not None
        err = ""
        while "leaving out node2" not in err:
            line = proc.stderr.readline()
            assert line, err
            err += line
    finally:
        set_link("node2", up=True)
    out, rest = proc.communicate(timeout=120)
    err += rest
    assert proc.returncode == 0, err
    assert "no word from the agent on node2" in err or "connection to node2" in err, err
    second = sorted((r, size, host) for a, r, size, host, _ in attempts_seen(out) if a == 1)
    assert second == [("0", "2", "node1"), ("1", "2", "node3")]
    assert wait_until_gone(mark, timeout=30) == []  # node2's agent ended its rank by itself


@pytest.mark.sshhosts
def test_a_host_whose_ranks_all_died_is_left_out_at_once(ssh_hosts: TestHosts, mark: str) -> None:
    """Every rank of node2 killed by a signal: node2 is left out, and the restart does not wait
    for a lost host's agent (--host-timeout): its ranks told they ended (before: the restart
    waited --host-timeout + --grace, 61 s here, long enough for the --blacklist-cooldown to
    let node2 back although dtrain said it was left out)."""
    program = (
        "import os, signal, time\n"
        "attempt, host = os.environ['DTRAIN_RESTART_COUNT'], os.uname().nodename\n"
        "print('attempt', attempt, 'rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " 'on', host, flush=True)\n"
        "if attempt == '0' and host == 'node2':\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # each dies by its own SIGKILL\n"
        "    time.sleep(1)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(2 if attempt == '0' else 0.2)\n"
    )
    result = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:2,node2:2", "-np", "4",
        "--min-np", "2", "--max-restarts", "1", "--restart-delay", "0",
        "--blacklist-cooldown", "20", "--host-timeout", "60", "--ssh-timeout", "30",
        "--grace", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "python3", "-c", program,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "restart 1 of 1 in 0 s" in result.stderr
    assert "dtrain: leaving out node2 (failed; back after 20 s)" in result.stderr
    second = sorted(
        line.split("] ", 1)[1] for line in result.stdout.splitlines() if "attempt 1" in line
    )
    assert second == [f"attempt 1 rank {r} of 2 on node1" for r in range(2)]
    assert wait_until_gone(mark) == []
