"""Functions that tests/test_api.py launches on ranks (importable: they travel by reference)."""

from __future__ import annotations

import os
import sys
import time


def rank_times(scale: int, offset: int = 0) -> int:
    rank = int(os.environ["RANK"])
    print(f"hello from rank {rank}")
    print("every rank says this")
    return rank * scale + offset


def world() -> dict[str, object]:
    """What a rank sees: its rank, the world, a variable given with env=, its sys.argv."""
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "marked": os.environ.get("API_TEST_VALUE"),
        "payload_left": sorted(k for k in os.environ if k.startswith("DTRAIN_FN_")),
        "argv": sys.argv,
    }


def fail_on(bad_rank: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad_rank:
        raise ValueError(f"rank {rank} cannot go on")
    time.sleep(60)  # the others: stopped by dtrain once bad_rank failed
    return rank


def ready_then_sleep() -> None:
    print("ready", flush=True)
    time.sleep(120)


def exits_early() -> None:
    os._exit(0)


def make_bytes(size: int) -> bytes:
    return b"x" * size


def wait_for_file(path: str) -> int:
    """Says it waits, then returns its rank once ``path`` exists (the test's go-ahead)."""
    print("waiting", flush=True)
    while not os.path.exists(path):
        time.sleep(0.02)
    return int(os.environ["RANK"])
