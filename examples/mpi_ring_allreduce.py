"""Ring-allreduce (Baidu, Horovod) with mpi4py, checked and timed against MPI.Allreduce.

    mpirun -np 4 python examples/mpi_ring_allreduce.py --sizes 1KB,64KB,1MB,16MB
    mpirun -np 5 python examples/mpi_ring_allreduce.py --check-only --sizes 1,3,7,1001 --dtype all

The buffer is cut into N chunks, one per rank.  In the reduce-scatter phase
each rank passes one chunk to its right neighbour and adds the chunk arriving
from its left neighbour, N-1 times, after which rank r holds the complete sum
of chunk r+1.  In the all-gather phase the completed chunks travel once more
around the ring, N-1 steps, overwriting instead of adding.  Every rank sends
and receives 2*(N-1)/N of the buffer, which hardly grows with N: that is why
the ring is bandwidth-optimal, and why "bus bandwidth" (nccl-tests) scales the
algorithm bandwidth by 2*(N-1)/N.

For every size the result is compared with ``comm.Allreduce`` (exactly for
integers, with a tolerance for floats, whose sums are added in a different
order), then both are timed.  Rank 0 prints one table; the exit status is 1 if
any rank saw a mismatch.  ``--sizes`` takes bytes with a suffix (``64KB``,
``16MB``; binary units, like nccl-tests) or a plain integer, meaning elements.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from mpi4py import MPI

DTYPES = ("float32", "float64", "int32", "int64")
DEFAULT_SIZES = "1KB,64KB,1MB,16MB"
SIZE_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
# One tag per phase, so a message of one phase can never be matched by the other.
TAG_REDUCE_SCATTER = 17
TAG_ALL_GATHER = 18


class RingComm(Protocol):
    """What the ring needs from a communicator: mpi4py's ``Intracomm`` or a test double."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = ...,
        recvbuf: Any = ...,
        source: int = ...,
        recvtag: int = ...,
    ) -> None: ...


def chunk_bounds(length: int, parts: int) -> list[int]:
    """Offsets of ``parts`` contiguous chunks covering ``length`` elements, sizes differing by <= 1.

    The first ``length % parts`` chunks get one extra element; when ``length < parts`` the last
    chunks are empty, and the ring still sends them (as zero-element messages) so that every
    rank does the same number of steps.
    """
    base, extra = divmod(length, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return bounds


def ring_allreduce(
    comm: RingComm, array: npt.NDArray[Any], *, out: npt.NDArray[Any] | None = None
) -> npt.NDArray[Any]:
    """Sum ``array`` over all ranks of ``comm`` with a ring; return the sum, same shape.

    The result goes into ``out`` if given (C-contiguous, same shape and dtype, not overlapping
    ``array``; like the receive buffer of ``MPI.Allreduce``), else into a new array.  ``array``
    is never modified.  Only ``Sendrecv`` with the two neighbours is used, no collective.  All
    ranks must pass arrays of the same shape and dtype.
    """
    # Chunks must be plain slices that MPI sends without packing: a flat C-order view (a copy
    # only if the caller's array is not contiguous).
    source = np.ascontiguousarray(array).reshape(-1)
    if out is None:
        out = np.empty(array.shape, dtype=array.dtype)
    elif out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {array.dtype}{array.shape}")
    elif np.may_share_memory(out, array):
        # Chunks of out receive partial sums before the same chunks of array are read.
        raise ValueError("out must not overlap array: the ring reads array while filling out")
    result = out.reshape(-1)  # a view: writing it fills out
    world, rank = comm.Get_size(), comm.Get_rank()
    if world == 1:
        result[...] = source
        return out
    right, left = (rank + 1) % world, (rank - 1) % world
    bounds = chunk_bounds(source.size, world)

    def chunk(buffer: npt.NDArray[Any], index: int) -> npt.NDArray[Any]:
        index %= world
        return buffer[bounds[index] : bounds[index + 1]]

    # Reduce-scatter: at step s rank r sends the partial sum of chunk r-s and receives chunk
    # r-s-1, to which it adds its own data.  The partial sum is received straight into that
    # chunk of the result, which is still unused: no copy of the input and no scratch buffer.
    # At large sizes that memory traffic (and fresh pages to fault in and zero) costs as much
    # as the transfers themselves; see docs/benchmarks.md.
    for step in range(world - 1):
        # Step 0 sends the rank's own data; later steps send the sum completed the step before.
        outgoing = chunk(source if step == 0 else result, rank - step)
        mine, incoming = chunk(source, rank - step - 1), chunk(result, rank - step - 1)
        comm.Sendrecv(outgoing, right, TAG_REDUCE_SCATTER, incoming, left, TAG_REDUCE_SCATTER)
        np.add(incoming, mine, out=incoming)

    # All-gather: rank r now holds the full sum of chunk r+1.  At step s it forwards chunk r+1-s
    # and receives chunk r-s, which its left neighbour completed or received the step before.
    for step in range(world - 1):
        outgoing, incoming = chunk(result, rank + 1 - step), chunk(result, rank - step)
        comm.Sendrecv(outgoing, right, TAG_ALL_GATHER, incoming, left, TAG_ALL_GATHER)
    return out


def parse_size(text: str) -> tuple[int, bool]:
    """``'64KB'`` -> (65536, True) bytes; ``'1001'`` -> (1001, False) elements."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"{text!r}: expected a count of elements (1001) or bytes (64KB, 16MB)")
    number, unit = int(match.group(1)), match.group(2)
    if number == 0:
        raise ValueError(f"{text!r}: size must be positive")
    if unit is None:
        return number, False
    return number * SIZE_UNITS[unit], True


def elements_for(size: tuple[int, bool], dtype: np.dtype[Any]) -> int:
    """Elements of ``dtype`` for a parsed size; a byte size must hold at least one element."""
    amount, in_bytes = size
    if not in_bytes:
        return amount
    if amount < dtype.itemsize:
        raise ValueError(
            f"{amount} bytes is smaller than one {dtype.name} ({dtype.itemsize} bytes)"
        )
    return amount // dtype.itemsize


def plural(count: int, noun: str) -> str:
    suffix = "" if count == 1 else ("es" if noun.endswith("h") else "s")
    return f"{count} {noun}{suffix}"


def format_bytes(count: int) -> str:
    for unit in ("GB", "MB", "KB"):
        scale = SIZE_UNITS[unit]
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return f"{count}B"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="comma-separated sizes: bytes with KB/MB/GB suffix (binary), or plain element counts"
        f" (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help=f"one of {', '.join(DTYPES)}, a comma-separated list, or 'all' (default float32)",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per timed loop")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed loops per size and algorithm, alternating ring and MPI; the median is kept"
        " (more than 1 makes the comparison robust to load from other processes)",
    )
    parser.add_argument(
        "--check-only", action="store_true", help="compare with MPI.Allreduce, time nothing"
    )
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_size(part) for part in args.sizes.split(",")]
    except ValueError as error:
        parser.error(f"--sizes: {error}")
    names = DTYPES if args.dtype == "all" else tuple(args.dtype.split(","))
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        parser.error(f"--dtype: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    args.dtypes = [np.dtype(name) for name in names]
    try:
        args.cases = [
            (dtype, elements_for(size, dtype)) for dtype in args.dtypes for size in args.sizes
        ]
    except ValueError as error:
        parser.error(f"--sizes: {error}")
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--iters and --repeats must be >= 1, --warmup >= 0")
    return args


def make_input(rank: int, elements: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Different data on every rank, reproducible; integers small enough never to overflow."""
    rng = np.random.default_rng([rank, elements])
    if dtype.kind == "f":
        return rng.standard_normal(elements).astype(dtype)
    return rng.integers(-1000, 1000, size=elements).astype(dtype)


def find_mismatch(ring: npt.NDArray[Any], reference: npt.NDArray[Any]) -> str | None:
    """Why ``ring`` differs from MPI's result, or None if it does not."""
    if ring.shape != reference.shape or ring.dtype != reference.dtype:
        return f"got {ring.dtype}{ring.shape}, expected {reference.dtype}{reference.shape}"
    if ring.dtype.kind == "f":
        # Summation order differs between the two algorithms; float32 carries ~7 digits.
        rtol, atol = (1e-5, 1e-5) if ring.dtype == np.float32 else (1e-12, 1e-12)
        bad = ~np.isclose(ring, reference, rtol=rtol, atol=atol)
    else:
        bad = ring != reference
    if not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    return (
        f"{int(bad.sum())} of {ring.size} elements differ; "
        f"first at {first}: ring {ring[first]!r}, MPI {reference[first]!r}"
    )


@dataclass(frozen=True)
class Timing:
    dtype: str
    nbytes: int
    elements: int
    ring_s: float
    mpi_s: float


def time_per_call(comm: MPI.Intracomm, call: Callable[[], object], iters: int) -> float:
    """Max over ranks of the mean seconds per call: the slowest rank is the collective's time."""
    from mpi4py import MPI

    comm.Barrier()  # start together, so no rank's time includes waiting for a late peer
    start = MPI.Wtime()
    for _ in range(iters):
        call()
    mean = (MPI.Wtime() - start) / iters
    return float(comm.allreduce(mean, op=MPI.MAX))


def time_both(
    comm: MPI.Intracomm,
    ring_call: Callable[[], object],
    mpi_call: Callable[[], object],
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Median seconds per call of each, over ``--repeats`` timed loops that alternate.

    Alternating (ring, MPI, MPI, ring, ...) puts both under the same background load, and the
    median drops a loop that a burst of another process's work happened to hit.
    """
    for _ in range(args.warmup):  # first-touch page faults, connection setup, caches
        ring_call()
        mpi_call()
    ring_times: list[float] = []
    mpi_times: list[float] = []
    for repeat in range(args.repeats):
        order = [(ring_call, ring_times), (mpi_call, mpi_times)]
        for call, times in order if repeat % 2 == 0 else reversed(order):
            times.append(time_per_call(comm, call, args.iters))
    return statistics.median(ring_times), statistics.median(mpi_times)


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth in GB/s: what each link carries, comparable across N."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def format_table(timings: Sequence[Timing], world: int, iters: int, repeats: int) -> str:
    header = (
        f"{'dtype':>8} {'size':>8} {'bytes':>11} {'elements':>10} {'ring_us':>11} {'mpi_us':>11}"
        f" {'ring_busbw':>10} {'mpi_busbw':>10} {'ring/mpi':>8}"
    )
    lines = [
        f"# ring-allreduce vs MPI.Allreduce on {plural(world, 'rank')}: time = max over ranks"
        f" of the mean of {iters} calls (median of {repeats} such loops), busbw in GB/s",
        header,
    ]
    for t in timings:
        lines.append(
            f"{t.dtype:>8} {format_bytes(t.nbytes):>8} {t.nbytes:>11d} {t.elements:>10d}"
            f" {t.ring_s * 1e6:>11.1f} {t.mpi_s * 1e6:>11.1f}"
            f" {bus_bandwidth(t.nbytes, t.ring_s, world):>10.3f}"
            f" {bus_bandwidth(t.nbytes, t.mpi_s, world):>10.3f}"
            # Ratio of bandwidths, i.e. MPI's time over the ring's: 1.0 means as fast as MPI.
            f" {t.mpi_s / t.ring_s:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported here, not at the top, so tests can import the pure parts without starting MPI.
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()

    failures = 0
    timings = []
    for dtype, elements in args.cases:
        data = make_input(rank, elements, dtype)
        original = data.copy()
        ring = ring_allreduce(comm, data)
        reference = np.empty_like(data)
        comm.Allreduce(data, reference, op=MPI.SUM)
        problem = find_mismatch(ring, reference)
        if problem is None and not np.array_equal(data, original):
            problem = "ring_allreduce modified its input"
        if problem is not None:
            failures += 1
            print(f"rank {rank}: {dtype.name} x {elements}: {problem}", file=sys.stderr)
        if args.check_only:
            continue
        # Both write into a preallocated result, so that neither pays for fresh pages per call.
        ring_call = functools.partial(ring_allreduce, comm, data, out=np.empty_like(data))
        mpi_call = functools.partial(comm.Allreduce, data, reference, op=MPI.SUM)
        ring_s, mpi_s = time_both(comm, ring_call, mpi_call, args)
        timings.append(Timing(dtype.name, data.nbytes, elements, ring_s, mpi_s))

    # Every rank must agree on the outcome, so that all exit with the same status.
    total_failures = comm.allreduce(failures, op=MPI.SUM)
    if rank == 0:
        if timings:
            print(format_table(timings, world, args.iters, args.repeats), flush=True)
        verdict = "ok" if total_failures == 0 else f"FAILED ({plural(total_failures, 'mismatch')})"
        print(f"# check: {len(args.cases)} cases on {plural(world, 'rank')}: {verdict}", flush=True)
    return 0 if total_failures == 0 else 1


def run_or_abort(entry: Callable[[], int]) -> int:
    """Run ``entry``; if it raises, print the traceback and abort the whole MPI job.

    A rank that simply dies leaves its peers blocked in Sendrecv forever (and mpirun with them);
    ``MPI.Abort`` ends every rank, as ``python -m mpi4py`` would.  SystemExit (argparse errors,
    which every rank raises alike) passes through.
    """
    try:
        return entry()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise  # not reached: Abort does not return


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
