"""Synchronous data-parallel training with mpi4py: a numpy MLP on scikit-learn's digits.

    mpirun -np 4 python examples/mpi_data_parallel.py

Every rank loads the same data set (8x8 images of handwritten digits, 10
classes, shipped inside scikit-learn) and the same train/test split.  Rank 0
draws the initial weights and broadcasts them.  Each step, every rank computes
the gradient on its share of the global batch, one ``Allreduce`` sums the
gradients of all ranks, and every rank applies the same update, so the weights
stay identical without ever being sent again.  At the end the ranks compare a
SHA-256 of their weights, and rank 0 prints the test accuracy.  Exits 1 if the
weights differ or the accuracy is below ``--min-accuracy``.

The model (64 -> hidden ReLU -> 10, softmax cross-entropy) and its backward
pass are written out in numpy, so the only communication is the one visible
here.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]
FEATURES = 64  # 8x8 pixels
CLASSES = 10
PIXEL_MAX = 16.0  # digits pixels are integers 0..16


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in one flat vector: parameters and gradients share the layout.

    One flat buffer means one Allreduce per step and one Bcast at the start, instead of one
    call per tensor, and a single array to hash at the end.
    """

    hidden: int

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return (FEATURES, self.hidden), (self.hidden,), (self.hidden, CLASSES), (CLASSES,)

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes)

    def views(self, flat: Array) -> tuple[Array, Array, Array, Array]:
        """(w1, b1, w2, b2) as views into ``flat``: writing to them writes to ``flat``."""
        views = []
        offset = 0
        for shape in self.shapes:
            count = int(np.prod(shape))
            views.append(flat[offset : offset + count].reshape(shape))
            offset += count
        w1, b1, w2, b2 = views
        return w1, b1, w2, b2


def init_params(layout: Layout, rng: np.random.Generator) -> Array:
    params = np.zeros(layout.size)
    w1, _, w2, _ = layout.views(params)
    # He initialisation for the ReLU layer, Glorot-like for the softmax layer; biases start at 0.
    w1[...] = rng.normal(0.0, np.sqrt(2.0 / FEATURES), w1.shape)
    w2[...] = rng.normal(0.0, np.sqrt(1.0 / layout.hidden), w2.shape)
    return params


def forward(layout: Layout, params: Array, inputs: Array) -> tuple[Array, Array]:
    """Hidden activations and logits for a batch of inputs."""
    w1, b1, w2, b2 = layout.views(params)
    hidden = np.maximum(inputs @ w1 + b1, 0.0)
    return hidden, hidden @ w2 + b2


def loss_and_gradient_sum(
    layout: Layout, params: Array, inputs: Array, labels: npt.NDArray[np.int64], grad: Array
) -> float:
    """Write into ``grad`` the gradient of the cross-entropy SUMMED over the batch; return the
    summed loss.

    Sums, not means: ranks hold different numbers of samples, and dividing the all-reduced sum
    by the all-reduced count weighs every sample equally, whatever the split.
    """
    g_w1, g_b1, g_w2, g_b2 = layout.views(grad)
    if len(labels) == 0:  # a rank with no share of a short last batch contributes nothing
        grad[...] = 0.0
        return 0.0
    hidden, logits = forward(layout, params, inputs)
    logits -= logits.max(axis=1, keepdims=True)  # exp() cannot overflow; softmax unchanged
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = -float(log_probs[rows, labels].sum())

    d_logits = np.exp(log_probs)
    d_logits[rows, labels] -= 1.0  # d(cross-entropy)/d(logits) = softmax - one_hot
    _, _, w2, _ = layout.views(params)
    g_w2[...] = hidden.T @ d_logits
    g_b2[...] = d_logits.sum(axis=0)
    d_hidden = (d_logits @ w2.T) * (hidden > 0.0)
    g_w1[...] = inputs.T @ d_hidden
    g_b1[...] = d_hidden.sum(axis=0)
    return loss


def accuracy(layout: Layout, params: Array, inputs: Array, labels: npt.NDArray[np.int64]) -> float:
    _, logits = forward(layout, params, inputs)
    return float((logits.argmax(axis=1) == labels).mean())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, all ranks")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units")
    parser.add_argument("--seed", type=int, default=0, help="split, initial weights, shuffling")
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1:
        parser.error("--epochs, --batch-size and --hidden must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported here so that `--help` and argument errors need neither MPI nor scikit-learn.
    from mpi4py import MPI
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # no stubs
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    started = time.perf_counter()

    images, targets = load_digits(return_X_y=True)
    # Same seed on every rank, so every rank holds the same split without any communication.
    train_x, test_x, train_y, test_y = train_test_split(
        images / PIXEL_MAX, targets, test_size=0.25, random_state=args.seed, stratify=targets
    )
    train_count = len(train_y)

    layout = Layout(args.hidden)
    params = init_params(layout, np.random.default_rng(args.seed)) if rank == 0 else None
    if params is None:
        params = np.empty(layout.size)
    # Broadcast rather than trust every rank's RNG: identical starting weights are the premise
    # of data parallelism, and a rank with another numpy version could draw other numbers.
    comm.Bcast(params, root=0)
    velocity = np.zeros_like(params)
    # One buffer for the step's Allreduce: gradient sum, then loss sum and sample count.
    packed = np.empty(layout.size + 2)
    grad = packed[: layout.size]

    for epoch in range(args.epochs):
        # The same permutation on every rank (seeded by epoch); each global batch is dealt
        # round-robin, so a rank's shard changes every epoch like torch's DistributedSampler,
        # and every rank takes the same number of steps even when world does not divide the
        # data (unequal step counts would leave a rank waiting in Allreduce forever).
        order = np.random.default_rng([args.seed, epoch]).permutation(train_count)
        epoch_loss = 0.0
        for start in range(0, train_count, args.batch_size):
            mine = order[start : start + args.batch_size][rank::world]
            packed[-2] = loss_and_gradient_sum(layout, params, train_x[mine], train_y[mine], grad)
            packed[-1] = len(mine)
            comm.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
            loss_sum, batch_count = packed[-2], packed[-1]
            # Same all-reduced numbers on every rank -> the same update -> the same weights.
            velocity *= args.momentum
            velocity -= args.lr * grad / batch_count
            params += velocity
            epoch_loss += loss_sum
        if rank == 0 and (epoch % 10 == 0 or epoch == args.epochs - 1):
            print(f"epoch {epoch:3d}  train loss {epoch_loss / train_count:.4f}", flush=True)

    # Compare digests, not whole weight vectors: a few bytes per rank settle "bit-identical".
    digests = comm.allgather(hashlib.sha256(params.tobytes()).hexdigest())
    if rank != 0:
        return 0 if len(set(digests)) == 1 else 1

    status = 0
    if len(set(digests)) != 1:
        differing = [r for r, digest in enumerate(digests) if digest != digests[0]]
        print(f"weights differ from rank 0's on ranks {differing}", file=sys.stderr)
        status = 1
    else:
        ranks = f"{world} rank" + ("s" if world != 1 else "")
        print(f"weights identical on all {ranks} (sha256 {digests[0][:16]})")
    test_accuracy = accuracy(layout, params, test_x, test_y)
    print(
        f"test accuracy {test_accuracy:.4f} on {len(test_y)} images "
        f"({train_count} training images, {args.epochs} epochs, "
        f"{time.perf_counter() - started:.1f} s)",
        flush=True,
    )
    if test_accuracy < args.min_accuracy:
        print(f"test accuracy below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        status = 1
    return status


def run_or_abort(entry: Callable[[], int]) -> int:
    """Run ``entry``; if it raises, print the traceback and abort the whole MPI job.

    A rank that simply dies leaves its peers blocked in Allreduce forever (and mpirun with
    them); ``MPI.Abort`` ends every rank, as ``python -m mpi4py`` would.  SystemExit (argparse
    errors, which every rank raises alike) passes through.
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
