"""Examples that checkpoint keep their state per job, in $DTRAIN_CHECKPOINT_DIR: a run of the
command the docs give trains from scratch (each run is a new job), and the checkpoints land
in the job's directory, not in the working directory (where a second run found the first's
last epoch and trained nothing); a run given an earlier job's folder resumes from it."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import JOBS, REPO, run_dtrain, wait_until_gone
from tests.test_ps import without_keras_env

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
def test_the_tf_ps_example_learns_keeps_its_checkpoints_per_job_and_resumes(
    tmp_path: Path, mark: str
) -> None:
    """A run trains from scratch into its job's checkpoints/ (not the working directory),
    learns, and leaves no ps or worker behind; a second job (--builtin-servers) given the
    first one's folder as --checkpoint-dir resumes at its last epoch and trains one more."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    ps = ["ps", "--workers", "2", "--ps", "1", "-x", f"DTRAIN_TEST_MARK={mark}"]
    example = ["python", "examples/tf_ps_train.py"]
    # asynchronous: 4 epochs ended at 0.898-0.93, too close to the bound
    env = without_keras_env()  # (no Keras here: the --builtin-servers start sooner)
    first = run_dtrain(*ps, *example, "--epochs", "6", cwd=tmp_path, timeout=280, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    folder = JOBS / first.stderr.split("dtrain: job ", 1)[1].split()[0] / "checkpoints"
    saved = re.findall(r"epoch (\d)/6: mean loss [\d.]+, saved (\S+)", first.stdout)
    assert [epoch for epoch, _ in saved] == ["1", "2", "3", "4", "5", "6"], first.stdout
    assert all(Path(path).parent == folder for _, path in saved), saved  # $DTRAIN_CHECKPOINT_DIR
    accuracy = re.findall(r"test accuracy: ([\d.]+)", first.stdout)
    assert "resumed" not in first.stdout and float(accuracy[-1]) >= 0.9, first.stdout
    assert wait_until_gone(mark) == []  # ps and workers were stopped when the chief ended
    assert not (tmp_path / "checkpoints").exists()  # nothing kept in the working directory
    again = run_dtrain(
        *ps, "--builtin-servers", *example, "--epochs", "7", "--checkpoint-dir", str(folder),
        cwd=tmp_path, timeout=280, env=env,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at epoch 6" in again.stdout, again.stdout
    assert re.findall(r"epoch (\d)/7: mean loss", again.stdout) == ["7"], again.stdout


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
