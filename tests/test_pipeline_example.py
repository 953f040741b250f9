"""examples/torch_pipeline_parallel.py for real: a model split over ranks (locally and over the
SSH test hosts) trains as the same model does in one process."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO, child_env, run_dtrain
from tests.testhosts import TestHosts

pytestmark = pytest.mark.slow  # real torch programs end to end
pytest.importorskip("torch")
pytest.importorskip("sklearn")

EXAMPLE = REPO / "examples" / "torch_pipeline_parallel.py"
TOLERANCE = 0.01  # on the test accuracy, as the README states


def load_example() -> ModuleType:
    if str(EXAMPLE.parent) not in sys.path:  # its devices.py, as `python examples/X.py` has it
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("dtrain_example_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_thread_env() -> dict[str, str]:
    """The tests' environment with one intra-op thread: what dtrain gives each of several ranks
    on a host, and what the one-process reference must use too (a matmul summed over 2 threads
    differs in the last bits, and 15 epochs grow that into the printed digits)."""
    return {**child_env(), "OMP_NUM_THREADS": "1"}


def run_example(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The example in one process, without dtrain."""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or one_thread_env(),
        cwd=REPO,
    )


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch \d+ mean loss ([\d.]+)", output)]


def accuracy(output: str) -> float:
    found = re.findall(r"test accuracy: ([\d.]+)", output)
    assert len(found) == 1, output  # the last stage alone prints it
    return float(found[0])


def run_example_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``python EXAMPLE ARGS`` run in this interpreter, which has torch loaded already
    (``load_example``): the example's own text as ``__main__`` (its arguments, its checks, its
    ``sys.exit``), with one intra-op thread as ``one_thread_env`` gives a process; its output
    is what that process prints, to the last digit (a torch process to start and end costs
    about 7 s of CPU, the training itself 2). The thread count and torch's random state are
    this process's again afterwards."""
    import torch

    load_example()  # torch, and the examples' folder on sys.path for its devices.py
    out, err = io.StringIO(), io.StringIO()
    argv, threads, code = sys.argv, torch.get_num_threads(), 0
    sys.argv = [str(EXAMPLE), *args]
    torch.set_num_threads(1)
    try:
        with (
            torch.random.fork_rng(devices=[]),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([str(EXAMPLE), *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """The one-process runs: the same micro-batches accumulated, and whole batches."""
    runs = {
        "micro": run_example_here("--single"),
        "whole": run_example_here("--single", "--micro-batches", "1"),
    }
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
        assert len(losses(run.stdout)) == 15
    return {name: run.stdout for name, run in runs.items()}


def assert_matches(output: str, reference: dict[str, str]) -> None:
    """The pipeline computed what one process computes: the same losses (to the printed
    digits, over every epoch) and the same accuracy; whole batches agree within the tolerance."""
    assert losses(output) == pytest.approx(losses(reference["micro"]), abs=2e-6)
    assert accuracy(output) == accuracy(reference["micro"])
    assert abs(accuracy(output) - accuracy(reference["whole"])) <= TOLERANCE
    assert accuracy(output) >= 0.9  # it did learn


def assert_split(output: str, stages: int) -> None:
    """Each rank holds its stage's parameters only, and together the whole model's."""
    held = [int(n) for n in re.findall(r"\] stage \d+: \d+ block\(s\), (\d+) parameters", output)]
    model = sum(p.numel() for b in load_example().build_blocks(3) for p in b.parameters())
    assert len(held) == stages and sum(held) == model and max(held) < model, output


@pytest.mark.parametrize(
    ("blocks", "stages", "sizes"),
    [(4, 2, [2, 2]), (4, 4, [1, 1, 1, 1]), (4, 3, [2, 1, 1]), (7, 3, [3, 2, 2]), (2, 2, [1, 1])],
)
def test_stages_share_the_blocks_in_order(blocks: int, stages: int, sizes: list[int]) -> None:
    example = load_example()
    model = example.build_blocks(blocks - 1)
    parts = [example.stage_of(model, s, stages) for s in range(stages)]
    assert [len(p) for p in parts] == sizes
    assert [b for p in parts for b in p] == model  # every block once, in order


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for PYTHONPATH where torch and sklearn fail to import: what is refused before
    they load (in a blink, not the seconds torch takes) never notices."""
    folder = tmp_path_factory.mktemp("without_torch")
    for name in ("torch", "sklearn"):
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} was imported')\n")
    return folder


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {}, "RANK and WORLD_SIZE are not set: run it with dtrain run -np 2, or with --single"),
        (["--single", "--micro-batches", "5"], {}, "--micro-batches 5 does not divide the batch"),
        (["--stages", "3"], {"RANK": "0", "WORLD_SIZE": "2"}, "--stages 3 but WORLD_SIZE is 2"),
        ([], {"RANK": "0", "WORLD_SIZE": "1"}, "a pipeline needs 2 stages or more"),
        ([], {"RANK": "0", "WORLD_SIZE": "6"}, "6 stages but the model has 4 blocks"),
        (
            ["--backend", "nccl", "--device", "cpu"], {"RANK": "0", "WORLD_SIZE": "2"},
            "--backend nccl cannot run with --device cpu: nccl runs on cuda tensors here",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_torch_loads(
    args: list[str], env: dict[str, str], message: str, without_torch: Path
) -> None:
    base = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE")}
    result = run_example(*args, env={**base, **env, "PYTHONPATH": str(without_torch)})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stderr.startswith("torch_pipeline_parallel.py: "), result.stderr


def test_the_documented_accuracies_are_the_references(reference: dict[str, str]) -> None:
    """docs/examples.md's figures are what the one-process runs print (which the pipelines
    must match, below): a figure in the docs comes from a run a test makes."""
    text = " ".join((REPO / "docs" / "examples.md").read_text().split())
    single = re.search(r"the same model in one process \(`--single`:[^)]*\) ([\d.]+)", text)
    whole = re.search(r"whole batches \(`--single --micro-batches 1`\) ([\d.]+)", text)
    stages = re.search(r"Test accuracy ([\d.]+) with 2 and with 4 stages", text)
    assert single and whole and stages, "docs/examples.md no longer gives these figures"
    assert float(single[1]) == float(stages[1]) == accuracy(reference["micro"])
    assert float(whole[1]) == accuracy(reference["whole"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine", ["p2p", "torch"])
def test_two_stages_train_as_one_process_does(
    reference: dict[str, str], mark: str, engine: str
) -> None:
    result = run_dtrain(
        "run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "python", str(EXAMPLE), "--engine", engine, timeout=180, env=one_thread_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[1] 2 stages (blocks per stage: 2, 2), 4 micro-batches" in result.stdout
    assert_split(result.stdout, 2)
    assert_matches("\n".join(ln for ln in result.stdout.splitlines() if ln.startswith("[1] ")),
                   reference)  # fmt: skip


@pytest.mark.sshhosts
@pytest.mark.timeout(280)
def test_four_stages_over_two_ssh_hosts(
    ssh_hosts: TestHosts, reference: dict[str, str], mark: str
) -> None:
    from tests.test_ssh import assert_nothing_left

    result = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-np", "4", "-H", "node1:2,node2:2",
        "-x", f"DTRAIN_TEST_MARK={mark}", "python", str(EXAMPLE), "--stages", "4", timeout=270,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = [ln for ln in result.stdout.splitlines() if ln.startswith("[3@node2] ")]
    assert "[3@node2] 4 stages (blocks per stage: 1, 1, 1, 1), 4 micro-batches" in last
    assert_split(result.stdout, 4)
    assert_matches("\n".join(last), reference)
    assert_nothing_left(ssh_hosts, mark)
