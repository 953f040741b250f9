"""Jobs and logs: the job directory, dtrain logs/jobs/stop, --detach, --json, filters."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from launcher.streams.joblist import find_job
from launcher.streams.joblogs import LogReader, parse_duration
from tests.conftest import (
    DTRAIN,
    JOBS,
    REPO,
    child_env,
    dtrain_in_process,
    py,
    run_dtrain,
    start_dtrain,
    tagged,
    wait_for_pids,
    wait_until_gone,
)


def job_id_of(stderr: str) -> str:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("dtrain: job "))
    return line.split()[2]


def test_job_directory_keeps_plan_status_and_timestamped_logs(mark: str) -> None:
    script = (
        "echo out $RANK; echo err $RANK >&2; printf 'p 1\\rp 2\\rp done\\n'; "
        "[ $RANK = 1 ] && sleep 1; exit $RANK"  # rank 0 is done before rank 1 fails
    )
    result = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script)
    assert result.returncode == 1
    job = JOBS / job_id_of(result.stderr)
    meta = json.loads((job / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["command"] == ["sh", "-c", script]
    plan = json.loads((job / "plan.json").read_text())
    assert [(e["rank"], e["host"]) for e in plan] == [(0, "localhost"), (1, "localhost")]
    status = json.loads((job / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1
    assert {r: (s["host"], s["status"]) for r, s in status["ranks"].items()} == {
        "0": ("localhost", 0),
        "1": ("localhost", 1),
    }
    assert all(s["pid"] > 0 and s["ended"] >= s["started"] for s in status["ranks"].values())
    log = (job / "rank.1.log").read_text().splitlines()
    stamps = [float(line.split(" ", 2)[0]) for line in log]
    assert stamps == sorted(stamps) and abs(stamps[0] - time.time()) < 120
    assert sorted(line.split(" ", 1)[1] for line in log) == sorted(
        ["o out 1", "e err 1", "o p done"]
    )


def test_logs_after_the_job_with_filters(mark: str) -> None:
    code = (
        "import os, sys, time\n"
        "r = os.environ['RANK']\n"
        "for i in range(3):\n"
        "    print(f'rank {r} step {i}', flush=True); time.sleep(0.05)\n"
        "print(f'rank {r} warn', file=sys.stderr)\n"
    )
    result = run_dtrain("run", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
    assert result.returncode == 0
    job = job_id_of(result.stderr)
    everything = dtrain_in_process("logs", job)
    assert everything.returncode == 0
    lines = everything.stdout.splitlines()
    assert len(lines) == 12
    for rank in range(3):
        assert tagged(everything.stdout, rank) == [f"rank {rank} step {i}" for i in range(3)]
        assert f"[{rank}]<stderr> rank {rank} warn" in lines
    only = dtrain_in_process("logs", job, "--rank", "0,2", "--grep", "step [12]").stdout
    assert sorted(only.splitlines()) == sorted(
        f"[{r}] rank {r} step {i}" for r in (0, 2) for i in (1, 2)
    )
    assert dtrain_in_process("logs", job, "--role", "ps").stdout == ""
    assert dtrain_in_process("logs", job, "--since", "1h").stdout == everything.stdout
    latest = dtrain_in_process("logs")  # no job named: the latest
    assert latest.stdout == everything.stdout


def test_follow_a_running_job_from_another_process(mark: str, tmp_path: Path) -> None:
    # Rank 1 fails once rank 0 has said everything (its failure stops rank 0: under load,
    # rank 0 may be steps behind).
    done = tmp_path / "rank0-done"
    code = (
        "import os, time\n"
        "for i in range(20):\n"
        "    print(f\"{os.environ['RANK']}:{i}\", flush=True); time.sleep(0.05)\n"
        f"done = {str(done)!r}\n"
        "if os.environ['RANK'] == '0':\n"
        "    open(done, 'w').close()\n"
        "    raise SystemExit(0)\n"
        "while not os.path.exists(done):\n"
        "    time.sleep(0.02)\n"
        "raise SystemExit(5)\n"
    )
    job = start_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
    wait_for_pids(mark, 2)
    follower = subprocess.run(
        [*DTRAIN, "logs", "-f"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=60,
    )
    job.communicate(timeout=60)
    assert follower.returncode == 5  # the job's exit code
    for rank in range(2):
        assert tagged(follower.stdout, rank) == [f"{rank}:{i}" for i in range(20)]


def test_detach_then_stop_leaves_nothing(mark: str) -> None:
    result = run_dtrain(
        "run",
        "--detach",
        "-np",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "echo started; sleep 300 & wait",
    )
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    wait_for_pids(mark, 2 * 3)
    listed = dtrain_in_process("jobs").stdout
    assert any(line.startswith(job) and " running " in line for line in listed.splitlines())
    stopped = run_dtrain("stop", job)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until_gone(mark) == []
    assert json.loads((JOBS / job / "status.json").read_text())["state"] == "stopped"
    assert "[0] started" in dtrain_in_process("logs", job).stdout
    again = dtrain_in_process("stop", job)  # (a refusal: nothing to signal)
    assert again.returncode == 2 and "is not running (stopped)" in again.stderr


def test_detached_job_that_cannot_start_reports_its_error() -> None:
    result = run_dtrain("run", "--detach", "-np", "2", "no-such-program-xyz")
    assert result.returncode == 2
    assert "program 'no-such-program-xyz' not found" in result.stderr


def test_json_lines_parse(mark: str) -> None:
    result = run_dtrain(
        "run",
        "--json",
        "-np",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "echo hello $RANK; echo oops >&2",
    )
    assert result.returncode == 0
    first, *records = [json.loads(line) for line in result.stdout.splitlines()]
    assert first["job"] and first["world_size"] == 2  # the first object names the job
    assert sorted((r["rank"], r["stream"], r["text"]) for r in records) == [
        (0, "stderr", "oops"),
        (0, "stdout", "hello 0"),
        (1, "stderr", "oops"),
        (1, "stdout", "hello 1"),
    ]
    assert all(
        r["host"] == "localhost" and r["role"] == "worker" and r["time"] > 0 for r in records
    )


def test_ranks_and_quiet_filter_the_terminal_not_the_job_directory(mark: str) -> None:
    shown = run_dtrain(
        "run",
        "-np",
        "3",
        "--ranks",
        "1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "echo hi $RANK",
    )
    assert shown.stdout.splitlines() == ["[1] hi 1"]
    kept = dtrain_in_process("logs", job_id_of(shown.stderr)).stdout.splitlines()
    assert sorted(kept) == ["[0] hi 0", "[1] hi 1", "[2] hi 2"]
    quiet = run_dtrain(
        "run",
        "-np",
        "2",
        "--quiet",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "echo hi; exit 2",
    )
    assert quiet.stdout == "" and quiet.returncode == 2
    assert re.search(r"dtrain: rank [01] on localhost failed \(exit code 2\)", quiet.stderr)


def test_every_line_reaches_the_job_directory_under_load(mark: str) -> None:
    lines = 50_000
    code = (
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        f"sys.stdout.write(''.join(f'{{r}} {{i}}\\n' for i in range({lines})))\n"
    )
    result = run_dtrain("run", "-np", "4", "--quiet", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
    assert result.returncode == 0
    reader = LogReader(find_job(JOBS, job_id_of(result.stderr)))
    got = reader.read_new()
    for rank in range(4):
        texts = [line.text for line in got if line.rank == rank]
        assert texts == [f"{rank} {i}".encode() for i in range(lines)]


def test_prune_removes_finished_jobs(tmp_path: Path) -> None:
    env = child_env()
    env["DTRAIN_JOB_DIR"] = str(tmp_path)
    assert run_dtrain("run", "-np", "1", "true", env=env).returncode == 0
    assert len(list(tmp_path.iterdir())) == 1
    pruned = dtrain_in_process("jobs", "--prune", env=env)
    assert pruned.returncode == 0 and "removed 1 finished job(s)" in pruned.stderr
    assert list(tmp_path.iterdir()) == []


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "10m", "2h", "1d", "1.5m")] == [
        90,
        90,
        600,
        7200,
        86400,
        90,
    ]


def test_live_view_on_a_terminal_redraws_progress_in_place(mark: str) -> None:
    import os
    import pty

    code = (
        "import sys, time\n"
        "for i in range(5):\n"
        "    sys.stdout.write(f'\\rprogress {i * 25}%'); sys.stdout.flush(); time.sleep(0.2)\n"
        "print(); print('done', flush=True)\n"
    )
    master, slave = pty.openpty()
    env = child_env()
    env.update({"TERM": "xterm-256color", "COLUMNS": "120", "LINES": "30"})
    proc = subprocess.Popen(
        [*DTRAIN, "run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=REPO,
    )
    os.close(slave)
    screen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal closed with the last process on it
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode("utf-8", "replace"))
    assert "1/1 running" in text  # the live status line while the rank ran
    assert "0/1 running" in text and "exited 1 (failed 0, stopped 0)" in text  # final state
    # A progress update drawn in the live region (the view redraws 4 times a second, the
    # bar moves every 0.2 s: which states are caught varies, that some is does not).
    assert re.search(r"\[0\] progress (0|25|50|75)%", text)
    assert "done" in text
    # the newline closed the last update: it was printed once, as a log line
    assert text.count("[0] progress 100%") == 1


def test_stop_does_not_signal_a_process_that_reused_the_launchers_pid(tmp_path: Path) -> None:
    import socket

    bystander = subprocess.Popen(["sleep", "60"])
    try:
        job = tmp_path / "20261123-000000-abcdef"
        job.mkdir()
        (job / "meta.json").write_text('{"id": "20261123-000000-abcdef"}')
        (job / "status.json").write_text(
            json.dumps(
                {
                    "state": "running",
                    "launcher_pid": bystander.pid,  # the pid, now another process's
                    "launcher_start": 1,  # the launcher started long before it
                    "launcher_host": socket.gethostname(),
                }
            )
        )
        result = dtrain_in_process("stop", "20261123", "--job-dir", str(tmp_path))
        assert result.returncode == 2
        assert "job 20261123-000000-abcdef is not running (lost)" in result.stderr
        assert bystander.poll() is None  # untouched
        listed = dtrain_in_process("jobs", "--job-dir", str(tmp_path))
        assert "lost" in listed.stdout
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_and_follow_without_naming_the_job(tmp_path: Path, mark: str) -> None:
    env = {**child_env(), "DTRAIN_JOB_DIR": str(tmp_path)}
    script = "for i in 1 2 3; do echo tick $i; sleep 0.2; done; sleep 300"
    first = run_dtrain(
        "run", "--detach", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script, env=env
    )
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip()
    followed = subprocess.Popen(
        [*DTRAIN, "logs", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    wait_for_pids(mark, 2)
    assert followed.stderr is not None
    # The follower has chosen its job before a second one exists (a busy machine may start
    # it late: then "the latest" would rightly be the second).
    following = followed.stderr.readline()
    assert f"dtrain: following job {job}" in following
    second = run_dtrain(
        "run", "--detach", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "300", env=env
    )
    other = second.stdout.strip()
    several = dtrain_in_process("stop", env=env)  # (a refusal: which one?)
    assert several.returncode == 2
    assert f"2 jobs are running: {job}, {other}" in several.stderr
    assert run_dtrain("stop", other, env=env).returncode == 0
    stopped = run_dtrain("stop", env=env)  # the only one left running
    assert stopped.returncode == 0 and f"dtrain: stopped job {job}" in stopped.stderr
    out, _ = followed.communicate(timeout=60)
    assert [line for line in out.splitlines() if "tick" in line] == [
        f"[0] tick {i}" for i in (1, 2, 3)
    ]
    assert followed.returncode == 143  # the followed job's exit code (stopped)
    none = dtrain_in_process("stop", env=env)
    assert none.returncode == 2 and "no job is running" in none.stderr


def test_jobs_lists_exit_codes_durations_and_filters(tmp_path: Path, mark: str) -> None:
    env = {**child_env(), "DTRAIN_JOB_DIR": str(tmp_path)}
    assert run_dtrain("run", "sh", "-c", "sleep 1; exit 3", env=env).returncode == 3
    assert run_dtrain("run", "true", env=env).returncode == 0
    live = run_dtrain("run", "--detach", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "300", env=env)
    running = live.stdout.strip()
    try:
        rows = [line.split() for line in dtrain_in_process("jobs", env=env).stdout.splitlines()]
        assert rows[0][:4] == ["job", "state", "exit", "took"]
        failed, ok, now = rows[1:]
        assert failed[1:3] == ["failed", "3"] and failed[3] in ("1s", "2s")
        assert ok[1:3] == ["succeeded", "0"]
        assert now[:3] == [running, "running", "-"]
        only = dtrain_in_process("jobs", "--running", env=env).stdout.splitlines()
        assert [line.split()[0] for line in only[1:]] == [running]
        last = dtrain_in_process("jobs", "-n", "2", env=env).stdout.splitlines()
        assert [line.split()[1] for line in last[1:]] == ["succeeded", "running"]
    finally:
        # (cleanup, not the subject: stop signals the job's launcher and waits for it)
        assert dtrain_in_process("stop", running, env=env).returncode == 0


def test_a_multi_line_command_is_one_row_of_the_jobs_table() -> None:
    from launcher.streams.joblist import JobSummary
    from launcher.view.tables import format_jobs

    program = "import time\nfor i in range(3):\n    print(i)"
    job = JobSummary("j1", "succeeded", "2", ("localhost",), 10, 1.0, ("python", "-c", program))
    lines = format_jobs([job])
    assert len(lines) == 2  # the header and the one row
    assert lines[1].endswith("python -c import time for i in range(3): print(i)")
