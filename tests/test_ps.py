"""`dtrain ps` for real: TensorFlow ParameterServerStrategy and torch.distributed.rpc jobs."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

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

needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow-cpu"
)
pytestmark = [pytest.mark.timeout(300)]


def accuracy_of(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if "test accuracy" in line)
    return float(line.rsplit(" ", 1)[1])


def job_status(job_id: str) -> dict[str, Any]:
    try:
        status: dict[str, Any] = json.loads((JOBS / job_id / "status.json").read_text())
        return status
    except (OSError, ValueError):
        return {}


def wait_for_line(job_id: str, text: str, timeout: float = 120) -> None:
    """Until ``dtrain logs JOB`` shows ``text``: read in this process (a ``dtrain logs``
    process every half second took a third of a core from the TensorFlow tasks starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = dtrain_in_process("logs", job_id).stdout
        if text in logs:
            return
        time.sleep(0.25)
    raise AssertionError(f"{text!r} never appeared in the logs of {job_id}")


def without_keras_env() -> dict[str, str]:
    """The tests' environment, with TensorFlow told not to load Keras at import (when the
    Keras 2 package, tf_keras, is absent, TF_USE_LEGACY_KERAS=1 makes TensorFlow skip it):
    about 2 s of CPU less per TensorFlow process that imports nothing else (a server, a
    resolver). No program here uses Keras (ParameterServerStrategy cannot), so nothing
    it computes changes."""
    env = child_env()
    if importlib.util.find_spec("tf_keras") is None:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def started_job_id(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("dtrain: job "), line
    return line.split()[2]


@needs_tf
@pytest.mark.slow
def test_tf_config_is_what_tensorflow_resolves(tmp_path: Path) -> None:
    plan = json.loads(
        dtrain_in_process(  # a dry run: what dtrain decides, not a process
            "ps",
            "--workers",
            "2",
            "--ps",
            "2",
            "--evaluator",
            "-H",
            "a:2,b:2",
            "--dry-run",
            "--json",
            "python",
            "train.py",
        ).stdout
    )
    code = (
        "import json, os, sys\n"
        "import tensorflow as tf\n"
        "TFConfigClusterResolver = tf.distribute.cluster_resolver.TFConfigClusterResolver\n"
        "out = []\n"
        "for config in json.load(sys.stdin):\n"
        "    os.environ['TF_CONFIG'] = config\n"
        "    r = TFConfigClusterResolver()\n"
        "    out.append([r.cluster_spec().as_dict(), r.task_type, r.task_id])\n"
        "print(json.dumps(out))\n"
    )
    resolved = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([e["env"]["TF_CONFIG"] for e in plan]),
        capture_output=True,
        text=True,
        timeout=120,
        env=without_keras_env(),
    )
    assert resolved.returncode == 0, resolved.stderr[-2000:]
    results = json.loads(resolved.stdout.strip().splitlines()[-1])
    # workers fill a's two slots; the two ps tasks spread, the least loaded host (b) first
    cluster = {"chief": ["a:29501"], "worker": ["a:29502", "a:29503"], "ps": ["b:29501", "a:29504"]}
    assert [r[0] for r in results] == [cluster] * 6
    assert [(r[1], r[2]) for r in results] == [
        ("chief", 0),
        ("worker", 0),
        ("worker", 1),
        ("ps", 0),
        ("ps", 1),
        ("evaluator", 0),
    ]
    for entry in plan:
        env = entry["env"]
        assert env["GRPC_FAIL_FAST"] == "use_caller" and env["DTRAIN_ROLE"] == entry["role"]
        assert "http_proxy" in entry["env_unset"] and "HTTPS_PROXY" in entry["env_unset"]
        if entry["role"] in ("chief", "ps"):
            assert env["CUDA_VISIBLE_DEVICES"] == ""


@needs_tf
@pytest.mark.slow
def test_killed_ps_fails_the_job_naming_it(mark: str, tmp_path: Path) -> None:
    proc = start_dtrain(
        "ps",
        "--workers",
        "2",
        "--ps",
        "1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "-x",  # the chief that dtrain stops leaves TensorFlow's autograph files in its TMPDIR
        f"TMPDIR={tmp_path}",
        "python",
        "examples/tf_ps_train.py",
        "--epochs",
        "200",
        "--checkpoint-dir",
        str(tmp_path),
    )
    job = started_job_id(proc)
    wait_for_line(job, "epoch 1/")
    ps = next(s for s in job_status(job)["ranks"].values() if s["role"] == "ps")
    os.killpg(ps["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL
    assert (
        f"dtrain: rank {ps['rank']} (ps) on localhost failed "
        "(killed by SIGKILL: out of memory? see dmesg on localhost)" in " ".join(err.split())
    )
    assert wait_until_gone(mark) == []


@needs_tf
@pytest.mark.slow
def test_killed_worker_is_restarted_and_training_completes(mark: str, tmp_path: Path) -> None:
    proc = start_dtrain(
        "ps",
        "--workers",
        "2",
        "--ps",
        "1",
        "--restart-workers",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/tf_ps_train.py",
        "--epochs",
        "6",
        "--checkpoint-dir",
        str(tmp_path),
    )
    job = started_job_id(proc)
    wait_for_line(job, "epoch 1/")
    worker = next(s for s in job_status(job)["ranks"].values() if s["role"] == "worker")
    os.killpg(worker["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err[-3000:]
    assert accuracy_of(out) >= 0.9
    final = job_status(job)
    assert final["state"] == "succeeded"
    assert final["ranks"][str(worker["rank"])]["restarts"] == 1
    assert f"dtrain: restarted rank {worker['rank']} (worker) on localhost (restart 1)" in err


@needs_tf
@pytest.mark.slow
def test_tf_multiworker_mirrored_under_run_tf(mark: str) -> None:
    result = run_dtrain(
        "run",
        "--tf",
        "-np",
        "3",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/tf_multiworker.py",
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert accuracy_of(result.stdout) >= 0.9
    assert "weights identical" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_torch_rpc_parameter_server(mark: str) -> None:
    result = run_dtrain(
        "ps",
        "--framework",
        "torch",
        "--workers",
        "2",
        "--ps",
        "1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/torch_rpc_ps.py",
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert accuracy_of(result.stdout) >= 0.9
    assert wait_until_gone(mark) == []


def test_builtin_servers_are_for_tensorflow() -> None:
    result = dtrain_in_process("ps", "--framework", "torch", "--builtin-servers", "true")
    assert result.returncode == 2
    assert "--builtin-servers is for --framework tf" in result.stderr


@needs_tf
@pytest.mark.slow
def test_a_standing_cluster_serves_a_coordinator(mark: str, tmp_path: Path) -> None:
    """dtrain ps --workers 2 --ps 1 with no program: the servers run until stopped, and a
    ParameterServerStrategy coordinator started by hand with the printed TF_CONFIG trains."""
    proc = start_dtrain(  # its servers import TensorFlow alone: no Keras needed
        "ps", "--workers", "2", "--ps", "1", "-x", f"DTRAIN_TEST_MARK={mark}",
        env=without_keras_env(),
    )  # fmt: skip
    try:
        wait_for_pids(mark, 3 * 2)  # per task: its watchdog and its server
        job = max(JOBS.iterdir(), key=lambda p: p.name)
        deadline = time.monotonic() + 30
        while not (job / "coordinator.sh").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tf_config = json.loads((job / "tf_config.json").read_text())
        assert tf_config["task"] == {"type": "chief", "index": 0}
        assert [len(tf_config["cluster"][r]) for r in ("chief", "worker", "ps")] == [1, 2, 1]
        env = {**child_env(), "TF_CONFIG": json.dumps(tf_config), "GRPC_FAIL_FAST": "use_caller"}
        env["TMPDIR"] = str(tmp_path)  # (TensorFlow's autograph files, if it dies)
        coordinator = subprocess.run(
            [
                sys.executable,
                "examples/tf_ps_train.py",
                "--epochs",
                "3",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=240,
        )
        assert coordinator.returncode == 0, coordinator.stderr[-3000:]
        assert accuracy_of(coordinator.stdout) >= 0.85
        assert proc.poll() is None  # the cluster outlives its coordinator
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert "export TF_CONFIG='" in err and "dtrain: stopped 3 ranks\n" in err
        assert "dtrain: interrupted by SIGINT; dtrain exits 130" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert wait_until_gone(mark) == []


def test_a_standing_cluster_is_for_tensorflow() -> None:
    result = dtrain_in_process("ps", "--framework", "torch", "--workers", "2")
    assert result.returncode == 2
    assert "dtrain ps --framework torch needs COMMAND" in result.stderr


def test_ps_output_is_tagged_by_role_and_task(mark: str, tmp_path: Path) -> None:
    # the chief ends the job once the other three have spoken (each leaves a file after)
    script = (
        f'echo "$DTRAIN_ROLE here"; touch {tmp_path}/$RANK; '
        f"if [ $DTRAIN_ROLE = chief ]; then until [ $(ls {tmp_path} | wc -l) = 4 ]; "
        "do sleep 0.05; done; exit 0; fi; "
        "exec sleep 300"  # no shell left to say "Terminated" when the job ends
    )
    result = run_dtrain(
        "ps", "--workers", "2", "--ps", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[chief] chief here",
        "[ps0] ps here",
        "[worker0] worker here",
        "[worker1] worker here",
    ]
    job = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    logged = dtrain_in_process("logs", job, "--role", "worker").stdout.splitlines()
    assert sorted(logged) == ["[worker0] worker here", "[worker1] worker here"]
    assert wait_until_gone(mark) == []


def test_a_worker_that_fails_for_good_is_told(mark: str, tmp_path: Path) -> None:
    """A worker failing once its --restart-workers budget is spent: the chief goes on, and
    the terminal says so (before: not a word, and the job "succeeded")."""
    # the chief ends once status.json has the worker's second failure (dtrain told it
    # when it took that in, before the chief's end), or after 10 s
    failed_twice = f'grep -qs \'"status": 9.*"restarts": 1\' {JOBS}/$DTRAIN_JOB_ID/status.json'
    script = (
        "echo $ROLE_NAME count=$DTRAIN_RESTART_COUNT; "
        "case $ROLE_NAME in ps) sleep 60;; "
        f"chief) i=0; until {failed_twice} || [ $i = 200 ]; do sleep 0.05; i=$((i+1)); done;; "
        "worker) exit 9;; esac"
    )
    result = run_dtrain(
        "ps", "--workers", "1", "--ps", "1", "--restart-workers", "1", "--grace", "1",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dtrain: restarted rank 1 (worker) on localhost (restart 1)" in result.stderr
    assert (
        "dtrain: rank 1 (worker) on localhost failed (exit code 9), no restart left "
        "(--restart-workers 1): the job goes on without it"
    ) in result.stderr
    assert wait_until_gone(mark) == []


def test_a_restarted_worker_sees_its_restart_count(mark: str, tmp_path: Path) -> None:
    done = tmp_path / "restarted"  # the chief ends once the restarted worker has run
    script = (
        "echo $ROLE_NAME count=$DTRAIN_RESTART_COUNT elastic=$TORCHELASTIC_RESTART_COUNT; "
        f"case $ROLE_NAME in ps) sleep 60;; chief) until [ -e {done} ]; do sleep 0.05; done;; "
        f'worker) [ "$DTRAIN_RESTART_COUNT" = 1 ] || exit 3; touch {done};; esac'
    )
    result = run_dtrain(
        "ps", "--workers", "1", "--ps", "1", "--restart-workers", "1",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dtrain: restarted rank 1 (worker) on localhost (restart 1)" in result.stderr
    worker = [line for line in result.stdout.splitlines() if line.startswith("[worker0]")]
    assert worker == ["[worker0] worker count=0 elastic=0", "[worker0] worker count=1 elastic=1"]
    assert wait_until_gone(mark) == []
