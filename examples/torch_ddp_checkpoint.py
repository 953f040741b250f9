"""Data-parallel training that survives failures: checkpoints, and resume on restart.

    dtrain run --max-restarts 3 -np 4 python examples/torch_ddp_checkpoint.py
    dtrain run --max-restarts 2 -np 4 python examples/torch_ddp_checkpoint.py --crash-at-step 60

An MLP learns scikit-learn's digits (shipped with the package: no download) with
DistributedDataParallel: over NCCL on the rank's GPU where CUDA is available, else over gloo
on the CPU (``--backend``/``--device`` force either; devices.py says which GPU a rank takes).
Every ``--checkpoint-every`` steps rank 0 writes
the model, the optimizer and the step to ``$DTRAIN_CHECKPOINT_DIR`` atomically
(write to a temporary file, fsync, rename, fsync the folder), so a crash can never
leave a torn checkpoint; on start every rank loads the latest one and goes on from
its step.  dtrain sets that folder per job: a new job starts from scratch, a restart
of the same job resumes (without dtrain: ``checkpoints/ddp`` here, or
``--checkpoint-dir``).  The order of the data depends only on the step (one seeded shuffle per
epoch, every rank its shard), so a job that restarts from a checkpoint makes the
same updates as one that never failed and ends with the same accuracy.

``--crash-at-step N`` makes rank ``--crash-rank`` kill itself with SIGKILL at step N
in the first attempt only (``DTRAIN_RESTART_COUNT`` is 0): a failure to recover from.
Checkpoints are saved from the device and loaded onto the CPU first, so a job on GPUs
resumes (on GPUs or not) as one on the CPU does.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from devices import add_device_flags, join_process_group
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 64
KEEP = 2  # checkpoints kept


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="STEPS")
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("DTRAIN_CHECKPOINT_DIR") or os.path.join("checkpoints", "ddp"),
        help="default: $DTRAIN_CHECKPOINT_DIR (dtrain sets it per job: a new job starts "
        "fresh, a restart resumes), else ./checkpoints/ddp",
    )
    parser.add_argument("--crash-at-step", type=int, default=None, metavar="N")
    parser.add_argument("--crash-rank", type=int, default=1)
    add_device_flags(parser)
    return parser.parse_args()


def load_data() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.2, random_state=0
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def batch_of(step: int, count: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sample indexes at ``step``: a function of the step alone."""
    per_epoch = count // GLOBAL_BATCH
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(1000 + epoch))
    batch = order[index * GLOBAL_BATCH : (index + 1) * GLOBAL_BATCH]
    return batch[rank::world]


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def resume_state(folder: Path, rank: int) -> dict[str, object] | None:
    """Rank 0's latest checkpoint, sent to every rank: where --checkpoint-dir is a folder of
    each host's own (not shared), only rank 0's host has it."""
    state = None
    if rank == 0:
        checkpoint = latest_checkpoint(folder)
        if checkpoint is not None:
            # onto the CPU: small to send, and every rank copies it onto its own device
            state = torch.load(checkpoint, weights_only=True, map_location="cpu")
            state["name"] = checkpoint.name
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(folder: Path, step: int, model: torch.nn.Module, optimizer: object) -> None:
    """Atomically: a reader sees the old checkpoint or the whole new one, never a part."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:06d}.pt"
    temporary = folder / f".step-{step:06d}.pt.tmp"
    with open(temporary, "wb") as f:
        torch.save(
            {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, f
        )  # type: ignore[attr-defined]
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
    for old in sorted(folder.glob("step-*.pt"))[:-KEEP]:
        old.unlink(missing_ok=True)


def main() -> int:
    args = parse_args()
    backend, device = join_process_group(args.backend, args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("DTRAIN_RESTART_COUNT", "0"))
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data())
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    net = net.to(device)
    model = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    folder = Path(args.checkpoint_dir)
    start = 0
    state = resume_state(folder, rank)
    if state is not None:
        net.load_state_dict(state["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        start = int(state["step"])  # type: ignore[call-overload]
        if rank == 0:
            print(f"attempt {attempt}: resuming from step {start} ({state['name']})")
    elif rank == 0:
        print(f"attempt {attempt}: starting from scratch ({world} ranks)")
    if rank == 0:
        print(f"attempt {attempt}: {backend}, rank 0 on {device}")
    total = args.epochs * (len(x_train) // GLOBAL_BATCH)
    loss = None
    for step in range(start, total):
        if step == args.crash_at_step and rank == args.crash_rank and attempt == 0:
            print(f"rank {rank}: crashing at step {step} (--crash-at-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        batch = batch_of(step, len(x_train), rank, world).to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        loss.backward()  # DDP averages the gradients over the ranks
        optimizer.step()
        done = step + 1
        if done % args.checkpoint_every == 0 or done == total:
            if rank == 0:
                save_checkpoint(folder, done, net, optimizer)
            dist.barrier()  # nobody runs ahead of a checkpoint that may be needed
        if rank == 0 and done % 50 == 0:
            print(f"step {done}/{total} loss {loss.item():.4f}")
    if start >= total and rank == 0:
        print(f"already trained ({total} steps)")
    if rank == 0:
        with torch.no_grad():
            accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
        print(f"test accuracy: {accuracy:.4f}")
    del model, optimizer, loss  # see torch_allreduce.py: DDP leaves before the group
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main()
    # Python's last garbage collection at exit walks every torch object (about a second of
    # CPU per process); nothing in that garbage needs cleaning up: skip it.
    gc.freeze()
    sys.exit(exit_code)
