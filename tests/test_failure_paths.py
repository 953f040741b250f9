"""The launcher's own failure paths: an exception mid-start, the SIGKILL fallback, a full
disk under the job directory, and dtrain stop's fallbacks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.base.errors import LauncherError
from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig, PlacementConfig
from launcher.core.hosts import Host
from launcher.run.job import run_job
from launcher.streams.jobdir import JobDir, process_start
from launcher.transport.local import LocalTransport
from tests.conftest import run_dtrain, tagged
from tests.fakes import FakeClock, FakeProcess, FakeTransport, RecordingFrontend
from tests.test_job import local_survey
from tests.test_transport import group_members


class FailingThirdStart(FakeTransport):
    """Starts ranks 0 and 1, then cannot start rank 2 (no more processes, say)."""

    def start(self, spec: LaunchSpec) -> FakeProcess:
        if spec.rank == 2:
            raise LauncherError("cannot start rank 2 on localhost: out of processes")
        return super().start(spec)


def test_an_error_while_starting_tears_down_what_started(tmp_path: Path) -> None:
    clock = FakeClock()
    transport = FailingThirdStart({r: ({}, None, False) for r in range(3)}, clock)
    config = JobConfig(command=("true",), placement=PlacementConfig(np=3), job_dir=str(tmp_path))
    with pytest.raises(LauncherError, match="out of processes"):
        run_job(
            config,
            {"PATH": os.environ["PATH"]},
            RecordingFrontend(),
            survey=local_survey,
            transports=lambda survey, config, environ: transport,
            clock=clock,
        )
    assert sorted(transport.started) == [0, 1]
    assert all(p.signals[:1] == [signal.SIGTERM] for p in transport.started.values())
    assert transport.closed
    (job,) = tmp_path.iterdir()
    assert JobDir(job).status()["state"] == "failed"  # not "running" forever


def test_sigkill_falls_back_to_the_group_when_the_watchdog_cannot() -> None:
    transport = LocalTransport(dict(os.environ), grace_s=30.0)
    process = transport.start(LaunchSpec(0, Host("localhost"), 0, argv=("sleep", "60"), env={}))
    deadline = time.monotonic() + 10
    while len(group_members(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGSTOP)  # the watchdog cannot act on the request
    process.signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(process.pid) == []  # the launcher killed the group itself
    assert process.wait() == -signal.SIGKILL


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: the job directory fills up mid-job."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    # mode=700: a job root others may write to is refused (a tmpfs's root is 1777)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=700", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_does_not_stop_the_job(tiny_disk: Path, mark: str) -> None:
    # Each rank writes ~1 MB of log lines: far more than the disk holds.
    code = "for i in range(20000): print(f'line {i:05d} ' + 'x' * 40)"
    result = run_dtrain(
        "run",
        "--plain",
        "--job-dir",
        str(tiny_disk),
        "-np",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "-c",
        code,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in range(2):  # the terminal got every line, whatever the disk did
        assert len(tagged(result.stdout, rank)) == 20000
    (job,) = tiny_disk.iterdir()
    assert (job / "meta.json").exists()


def fake_running_job(root: Path, pid: int, grace_s: float) -> str:
    job_id = "20261123-000000-abcdef"
    (root / job_id).mkdir(parents=True)
    (root / job_id / "meta.json").write_text(json.dumps({"id": job_id, "grace_s": grace_s}))
    (root / job_id / "status.json").write_text(
        json.dumps(
            {
                "state": "running",
                "launcher_pid": pid,
                "launcher_start": process_start(pid),
                "launcher_host": socket.gethostname(),
            }
        )
    )
    return job_id


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_stop_kills_a_launcher_that_does_not_stop(tmp_path: Path) -> None:
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
    try:
        time.sleep(0.2)  # the trap is set
        job = fake_running_job(tmp_path, stubborn.pid, grace_s=0)
        result = run_dtrain("stop", job, "--job-dir", str(tmp_path), timeout=40)
        assert result.returncode == 0, result.stderr
        assert f"dtrain: stopped job {job}" in result.stderr
        assert stubborn.wait(timeout=5) == -signal.SIGKILL  # after the grace and the extra wait
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
        stubborn.wait()


def test_stop_a_job_whose_launcher_ends_on_its_own(tmp_path: Path) -> None:
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        job = fake_running_job(tmp_path, launcher.pid, grace_s=5)
        result = run_dtrain("stop", job, "--job-dir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert launcher.wait(timeout=5) == -signal.SIGTERM
        assert (tmp_path / job / "stop-requested").exists()  # the launcher records "stopped"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
