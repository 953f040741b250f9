"""dtrain-netreduce: one rank of ``dtrain check --network``'s allreduce, started by
``netcheck.py`` on each host (``python -I -c SOURCE``).  Stdlib only until torch.

It imports torch at once (the import overlaps the point-to-point measurements) and says
``{"ready": {"torch", "cuda"}}``, or ``{"skipped": why}`` where torch is not importable;
then it reads one line, the rendezvous (``master_addr``, ``master_port``, ``rank``,
``world``, ``backend``, ``interface``, ``budget_s``), runs a few allreduces of a tensor
sized to the time left, and says ``{"result": {...}}`` (or ``{"error": ...}``): the bus
bandwidth as nccl-tests defines it, algbw * 2(n-1)/n.  The end of its stdin (netcheck
gone) ends it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

WARMUP_BYTES = 1 << 20
MAX_BYTES = 64 << 20
ITERATIONS = 5
TARGET_S = 0.25  # per iteration, at most


def say(message: dict) -> None:  # type: ignore[type-arg]
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def exit_when_orphaned() -> None:
    """netcheck (the parent) holds our stdin: its end is ours."""
    sys.stdin.read()
    os._exit(1)


def tensor_bytes(warmup_s: float, budget_s: float) -> int:
    """The largest power of two from 1 MiB to 64 MiB whose iterations fit the budget (the
    same on every rank: it is computed from values every rank agreed on)."""
    per_iteration_s = min(TARGET_S, budget_s / (2 * ITERATIONS))
    size = WARMUP_BYTES
    while size * 2 <= MAX_BYTES and warmup_s * (size * 2) / WARMUP_BYTES <= per_iteration_s:
        size *= 2
    return size


def allreduce(torch, dist, params: dict) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """A few timed allreduces over every host, one rank each."""
    from datetime import timedelta

    started = time.monotonic()
    budget_s = float(params["budget_s"])
    backend = params["backend"]
    world = int(params["world"])
    dist.init_process_group(
        backend,
        rank=int(params["rank"]),
        world_size=world,
        timeout=timedelta(seconds=max(budget_s, 1.0)),
    )
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")

    def timed(tensor, times: int) -> float:  # type: ignore[no-untyped-def]
        if backend == "nccl":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for _ in range(times):
            dist.all_reduce(tensor)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - begin) / times

    warmup = torch.ones(WARMUP_BYTES // 4, dtype=torch.float32, device=device)
    timed(warmup, 1)  # (connections are made on the first one)
    agreed = torch.tensor([timed(warmup, 2)], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    size = tensor_bytes(float(agreed.item()), budget_s - (time.monotonic() - started))
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    seconds = timed(tensor, ITERATIONS)
    dist.destroy_process_group()
    algbw = size / seconds
    return {
        "backend": backend,
        "hosts": world,
        "bytes": size,
        "iterations": ITERATIONS,
        "seconds": seconds,
        "algbw_bytes_per_s": algbw,
        "busbw_bytes_per_s": algbw * 2 * (world - 1) / world,
    }


def main() -> None:
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:
        say({"skipped": f"torch is not importable there ({exc.__class__.__name__}: {exc})"})
        return
    cuda = bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    say({"ready": {"torch": torch.__version__, "cuda": cuda}})
    line = sys.stdin.readline()
    if not line:
        return
    params = json.loads(line)
    threading.Thread(target=exit_when_orphaned, daemon=True).start()
    os.environ["MASTER_ADDR"] = params["master_addr"]
    os.environ["MASTER_PORT"] = str(params["master_port"])
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        os.environ.setdefault(name, params["interface"])  # the ranks' own, as dtrain sets it
    try:
        say({"result": allreduce(torch, dist, params)})
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        say({"error": f"{exc.__class__.__name__}: {first}"})


if __name__ == "__main__":
    main()
