"""A real torch.distributed job: all_reduce checks, then data-parallel training.

    dtrain run -np 4 python examples/torch_allreduce.py
    dtrain run -np 4 python examples/torch_allreduce.py --device cpu   # gloo on a GPU host too

Each rank joins the process group from the variables dtrain sets (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE): over NCCL on its GPU where CUDA is available, else
over gloo on the CPU (``--backend {auto,nccl,gloo}`` and ``--device {auto,cuda,cpu}``
force either; devices.py says which GPU a rank takes, with dtrain's GPU binding and
with ``--no-gpu-binding``).  It checks that all_reduce sums correctly (each rank says
its backend and device), trains a small model with DistributedDataParallel on its
shard of a synthetic regression problem, and checks that every rank ends with the
same weights.  Exits non-zero on any mismatch, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from devices import add_device_flags, join_process_group
from torch.nn.parallel import DistributedDataParallel

STEPS = 50


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_flags(parser)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    backend, device = join_process_group(args.backend, args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    where = f"rank {rank}/{world} (local {local_rank}) on {socket.gethostname()}"
    print(f"{where}: {backend} on {device}")

    value = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if not torch.allclose(value, torch.full((4,), expected, device=device)):
        print(f"all_reduce gave {value.tolist()}, expected {expected}", file=sys.stderr)
        return 1
    print(f"{where}: all_reduce sum = {value[0].item():g} ok")

    torch.manual_seed(0)  # same data and initial weights on every rank (drawn on the CPU)
    true_w = torch.randn(8, 1)
    inputs = torch.randn(1024, 8)
    targets = inputs @ true_w + 0.01 * torch.randn(1024, 1)
    inputs, targets = inputs.to(device), targets.to(device)
    shard = slice(rank, None, world)
    on_gpu = [device] if device.type == "cuda" else None
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device), device_ids=on_gpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[shard]), targets[shard])
        loss.backward()  # DDP averages the gradients with an allreduce
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d} loss {loss.item():.5f}")

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if not all(torch.equal(gathered[0], w) for w in gathered):
        print("ranks ended with different weights", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"final loss {loss.item():.5f}; weights identical on all {world} ranks")
    # Leave together, DDP first: gloo aborts a rank (std::terminate, SIGABRT) whose
    # peers hang up while its DDP reducer still holds the process group.  The last
    # loss keeps the autograd graph, and through it the reducer, alive: drop it too,
    # and collect the cycles, before the barrier (2 of 9 runs aborted without this).
    del model, optimizer, loss
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
