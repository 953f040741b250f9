"""GPU checks, for a machine with a GPU and torch with CUDA: ``./scripts/gpu-check`` (or
``python -m pytest -m gpu tests/test_gpu.py -v``).  Where torch or CUDA is missing (CI) every
test skips, saying why.

Each runs the real ``dtrain`` on this machine, local ranks only (no SSH, Open MPI or
TensorFlow needed): the torch examples over NCCL with one rank per GPU (bound by dtrain,
and with ``--no-gpu-binding``), a CUDA job that loses a rank and resumes from its
checkpoint to an unbroken run's loss, ``top`` and ``stacks`` on a CUDA rank, and
``--hang-timeout`` on a rank stuck in an NCCL collective.  Each prints one line of what it
saw (``-s`` shows them)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, run_dtrain, start_dtrain, tagged, wait_until_gone

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def gpus() -> int:
    """How many CUDA devices torch sees here; the test skips where there are none."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch with CUDA (torch is not installed here)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: torch.cuda.is_available() is false here")
    return torch.cuda.device_count()


def py_spy() -> str | None:
    """py-spy as dtrain's agent finds it: beside this Python, or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def test_allreduce_over_nccl_with_one_rank_per_gpu(gpus: int, mark: str) -> None:
    """Bound by dtrain, each rank sees its own GPU as cuda:0; with --no-gpu-binding each sees
    every GPU and takes cuda:LOCAL_RANK.  NCCL either way, and the sums are right."""
    total = gpus * (gpus + 1) // 2
    for binding in ([], ["--no-gpu-binding"]):
        done = run_dtrain(
            "run", "-np", str(gpus), *binding, "-x", f"DTRAIN_TEST_MARK={mark}",
            "python", str(EXAMPLES / "torch_allreduce.py"), timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        for rank in range(gpus):
            said = [line.split(": ", 1)[1] for line in tagged(done.stdout, rank) if ": " in line]
            device = f"cuda:{rank}" if binding else "cuda:0"
            assert said[:2] == [f"nccl on {device}", f"all_reduce sum = {total} ok"], done.stdout
        assert f"weights identical on all {gpus} ranks" in done.stdout
        final = re.findall(r"final loss ([\d.]+)", done.stdout)
        print(f"\nallreduce {' '.join(binding) or 'bound'}: {gpus} rank(s) on nccl, sum {total} "
              f"ok, final loss {final}")  # fmt: skip
    assert wait_until_gone(mark) == []


def test_a_cuda_job_that_loses_a_rank_resumes_to_the_same_loss(
    gpus: int, tmp_path: Path, mark: str
) -> None:
    """As tests/test_restarts.py does on the CPU: the same job unbroken and with a rank that
    kills itself at step 70 (the restart resumes from step 60), each into a checkpoint
    folder that does not exist yet (dtrain makes it)."""
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs scikit-learn (the example's data set): pip install scikit-learn")
    ranks = min(gpus, 2)
    common = ["run", "-np", str(ranks), "--max-restarts", "1", "--restart-delay", "0"]
    common += ["-x", f"DTRAIN_TEST_MARK={mark}"]
    example = ["python", str(EXAMPLES / "torch_ddp_checkpoint.py")]
    clean = run_dtrain(
        *common, "--checkpoint-dir", str(tmp_path / "a" / "ckpt"), *example, timeout=240
    )
    crashed = run_dtrain(
        *common, "--checkpoint-dir", str(tmp_path / "b" / "ckpt"), *example,
        "--crash-at-step", "70", "--crash-rank", str(ranks - 1), timeout=240,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    for run in (clean, crashed):
        assert "attempt 0: nccl, rank 0 on cuda:0" in run.stdout, run.stdout
    assert "attempt 1: resuming from step 60 (step-000060.pt)" in crashed.stdout
    assert "restart 1 of 1" in crashed.stderr and "restart 1 of" not in clean.stderr
    losses = [dict(re.findall(r"step (\d+)/\d+ loss ([\d.]+)", r.stdout)) for r in (clean, crashed)]
    last = max(losses[0], key=int)
    accuracy = [
        float(re.findall(r"test accuracy: ([\d.]+)", r.stdout)[-1]) for r in (clean, crashed)
    ]
    print(f"\nddp on cuda: loss at step {last} {losses[0][last]} unbroken, {losses[1].get(last)} "
          f"resumed; test accuracy {accuracy[0]} and {accuracy[1]}")  # fmt: skip
    assert abs(float(losses[0][last]) - float(losses[1][last])) <= 0.001  # (printed to 4 places)
    assert abs(accuracy[0] - accuracy[1]) <= 0.01 and accuracy[0] >= 0.9


ON_THE_GPU = """import os, time
import torch
def spin_on_the_gpu(x, stop, end):
    while not os.path.exists(stop) and time.monotonic() < end:
        for _ in range(10):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
x = torch.randn(4096, 4096, device="cuda")  # 64 MiB, and the CUDA context
print("on the gpu", flush=True)
spin_on_the_gpu(x, os.environ["STOP_FILE"], time.monotonic() + 180)
"""


@pytest.fixture(scope="module")
def cuda_job(gpus: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A job of one rank busy on the GPU: its id, while it runs."""
    folder = tmp_path_factory.mktemp("cuda_job")
    (folder / "on_the_gpu.py").write_text(ON_THE_GPU)
    stop, mark = folder / "stop", uuid.uuid4().hex
    proc = start_dtrain(
        "run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "-x", f"STOP_FILE={stop}",
        "python", str(folder / "on_the_gpu.py"),
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        while not (line := proc.stderr.readline()).startswith("dtrain: job "):
            assert line, "dtrain ended before it started the job"
        job = line.split()[2]
        while "on the gpu" not in (line := proc.stdout.readline()):
            assert line, "the job ended before its rank was on the GPU"
        yield job
    finally:
        stop.touch()
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert wait_until_gone(mark) == []


def test_top_shows_a_cuda_ranks_gpu_memory(cuda_job: str) -> None:
    shown = run_dtrain("top", "--once", "--json", cuda_job)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)
    print(f"\ntop: gpu_mib {row['gpu_mib']}, gpu_percent {row['gpu_percent']}")
    assert row["state"] == "running"
    assert isinstance(row["gpu_mib"], int) and row["gpu_mib"] >= 64, row
    assert isinstance(row["gpu_percent"], int), row


def test_stacks_show_a_cuda_ranks_python_frames(cuda_job: str) -> None:
    if py_spy() is None:
        pytest.skip("needs py-spy (dtrain stacks uses it): pip install py-spy")
    shown = run_dtrain("stacks", cuda_job)
    assert shown.returncode == 0, shown.stderr
    print(f"\nstacks:\n{shown.stdout}")
    assert "rank 0 of 1 on localhost (main thread):" in shown.stdout
    assert re.search(r"^    spin_on_the_gpu \(.*on_the_gpu\.py:\d+\)$", shown.stdout, re.M)


# Rank 0 waits in an all_reduce that rank 1 never joins.  On one GPU both ranks see it
# (--no-gpu-binding), and NCCL cannot put two ranks of a group on one GPU: rank 1 never
# touches it, and rank 0 waits in the communicator's set-up (made by its first collective).
# With a GPU each, they meet in a first all_reduce, then rank 0's second one never ends.
# Until then every rank says it is starting: no silence (no hang) before the collective.
STUCK = """import os, sys, threading, time
started = threading.Event()
def say_starting():
    while not started.wait(0.5):
        print("starting", flush=True)
threading.Thread(target=say_starting, daemon=True).start()
import torch
import torch.distributed as dist
rank, shared = int(os.environ["RANK"]), sys.argv[1] == "shared"
def wait_in_all_reduce():
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
def stay_out():
    time.sleep(300)
if shared:
    dist.init_process_group("nccl")
else:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
started.set()
if rank == 0:
    torch.cuda.set_device(0)
    print("rank 0 waits in the all_reduce", flush=True)
    wait_in_all_reduce()
else:
    print("rank 1 stays out", flush=True)
    stay_out()
"""


def test_hang_timeout_stops_a_rank_stuck_in_an_nccl_collective(
    gpus: int, tmp_path: Path, mark: str
) -> None:
    (tmp_path / "stuck.py").write_text(STUCK)
    layout = ["--no-gpu-binding", "shared"] if gpus == 1 else ["own"]
    done = run_dtrain(
        "run", "-np", "2", *layout[:-1], "--hang-timeout", "3", "-x", f"DTRAIN_TEST_MARK={mark}",
        "python", str(tmp_path / "stuck.py"), layout[-1], timeout=240,
    )  # fmt: skip
    summary = done.stderr.strip().splitlines()[-4:]
    print("\nhang-timeout (" + layout[-1] + " GPU): exit code", done.returncode, *summary, sep="\n")
    assert done.returncode == 124, done.stderr[-3000:]
    assert "rank 0 waits in the all_reduce" in done.stdout and "rank 1 stays out" in done.stdout
    told = " ".join(done.stderr.split())
    assert "dtrain: no output from any rank for 3 s (--hang-timeout)" in told, done.stderr
    if py_spy() is not None:
        assert "wait_in_all_reduce" in told and "stay_out" in told, done.stderr
    assert wait_until_gone(mark) == []
