"""Examples that checkpoint keep their state per job, in $DTRAIN_CHECKPOINT_DIR: the command
the docs give, run twice, trains twice (each run is a new job, which starts fresh), and the
checkpoints land in the job's directory, not in the working directory (where a second run
found the first's last epoch and trained nothing)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import JOBS, REPO, run_dtrain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def run_twice(tmp_path: Path, *command: str) -> list[tuple[str, Path]]:
    """The command's stdout and its job's directory, twice, run where the examples are
    copied (a fresh working directory: nothing of an earlier run of the suite is there)."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    runs = []
    for _ in range(2):
        done = run_dtrain(*command, cwd=tmp_path, timeout=280)
        assert done.returncode == 0, done.stderr[-3000:]
        job = done.stderr.split("dtrain: job ", 1)[1].split()[0]
        runs.append((done.stdout, JOBS / job))
    return runs


@needs("tensorflow", "sklearn")
def test_the_tf_ps_example_trains_at_every_run(tmp_path: Path) -> None:
    runs = run_twice(
        tmp_path,
        "ps", "--workers", "2", "--ps", "1", "python", "examples/tf_ps_train.py", "--epochs", "1",
    )  # fmt: skip
    saved = [re.findall(r"epoch 1/1: mean loss [\d.]+, saved (\S+)", out) for out, _ in runs]
    assert [len(s) for s in saved] == [1, 1], [out for out, _ in runs]  # trained, both times
    for (_, job), (path,) in zip(runs, saved, strict=True):
        assert Path(path).parent == job / "checkpoints", path  # $DTRAIN_CHECKPOINT_DIR
    assert not (tmp_path / "checkpoints").exists()  # nothing kept in the working directory


@needs("torch", "sklearn")
def test_the_ddp_checkpoint_example_trains_at_every_run(tmp_path: Path) -> None:
    runs = run_twice(
        tmp_path,
        "run", "--max-restarts", "3", "-np", "2", "python", "examples/torch_ddp_checkpoint.py",
        "--epochs", "1",
    )  # fmt: skip
    for out, job in runs:
        assert "attempt 0: starting from scratch (2 ranks)" in out, out
        assert "already trained" not in out and "test accuracy" in out, out
        assert list((job / "checkpoints").glob("step-*.pt")), job  # $DTRAIN_CHECKPOINT_DIR
    assert not (tmp_path / "checkpoints").exists()  # nothing kept in the working directory
