"""Time limits for real: --hang-timeout (stacks, then 124, or --on-hang dump), --timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import JOBS, run_dtrain, wait_until_gone

pytestmark = pytest.mark.timeout(120)

# Each rank goes into its function (lines 3 and 5, which the summary names), then waits
# there until every rank is in its own, printing meanwhile: no silence, hence no hang, can
# begin before then, however long a rank takes to start on a busy machine.
HUNG = """import os, time
def wait_in_all_reduce():
    all_here(); time.sleep(60)
def wander_elsewhere():
    all_here(); time.sleep(60)
def all_here():
    open(f"here-{os.environ['RANK']}", "w").close()
    while len([n for n in os.listdir() if n.startswith("here-")]) < int(os.environ["WORLD_SIZE"]):
        print("waiting for the others", flush=True)
        time.sleep(0.1)
    print("ready", flush=True)
if os.environ["RANK"] == "2":
    wander_elsewhere()
else:
    wait_in_all_reduce()
"""


def test_a_hang_shows_every_ranks_stack_and_fails_with_124(tmp_path: Path, mark: str) -> None:
    (tmp_path / "train.py").write_text(HUNG)
    result = run_dtrain(
        "run", "-np", "4", "--hang-timeout", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "train.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 124, result.stderr
    summary = result.stderr.strip().splitlines()[-4:]
    assert summary == [  # (the last line, broken between words to fit 80 columns)
        "dtrain: stopped 4 ranks",
        "dtrain: no output from any rank for 2 s (--hang-timeout): ranks 0-1,3 in",
        "    wait_in_all_reduce (train.py:3), rank 2 in wander_elsewhere (train.py:5);",
        "    dtrain exits 124",
    ]
    assert "    rank 2 of 4 on localhost (main thread):   <-- differs from the others" in (
        result.stderr
    )
    job = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    saved = (JOBS / job / "stacks.txt").read_text()
    assert f"wander_elsewhere ({tmp_path / 'train.py'}:5)" in saved
    assert wait_until_gone(mark) == []


def test_on_hang_dump_keeps_the_job_going(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        "import time\nprint('start', flush=True)\ntime.sleep(3)\nprint('end', flush=True)\n"
    )
    result = run_dtrain(
        "run", "-np", "2", "--hang-timeout", "1", "--on-hang", "dump", "slow.py", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "dtrain: no output from any rank for 1 s; their stacks:" in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] end", "[0] start", "[1] end", "[1] start"]


def test_output_keeps_a_job_from_being_hung() -> None:
    """Ranks that print every 0.1 s for 3 s outlive a --hang-timeout of 1.5 s: a shell loop,
    which starts in milliseconds (a Python rank's start on a busy machine could itself take
    most of the timeout), and gaps 15 times shorter than it."""
    loop = "for i in $(seq 30); do echo $i; sleep 0.1; done"
    result = run_dtrain("run", "-np", "2", "--hang-timeout", "1.5", "sh", "-c", loop)
    assert result.returncode == 0, result.stderr
    assert "stacks" not in result.stderr
    assert sorted(result.stdout.splitlines()) == sorted(
        f"[{r}] {i}" for r in (0, 1) for i in range(1, 31)
    )


def test_the_wall_clock_limit(mark: str) -> None:
    result = run_dtrain(
        "run", "-np", "2", "--timeout", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "30"
    )
    assert result.returncode == 124
    assert result.stderr.strip().splitlines()[-3:] == [
        "dtrain: stopped 2 ranks",
        "dtrain: the job ran longer than --timeout 1 s (rank(s) 0-1 on localhost still",
        "    running); dtrain exits 124",
    ]
    assert wait_until_gone(mark) == []
