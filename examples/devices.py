"""Which backend and device a rank of the torch examples uses: NCCL on a GPU where CUDA is
available, gloo on the CPU otherwise.

    dtrain run -np 2 python examples/torch_allreduce.py [--backend B] [--device D]

``auto`` (the default of both) takes NCCL and ``cuda`` when torch sees a CUDA device, else
gloo and ``cpu``.  Either flag forces the pair: ``--device cpu`` (or ``--backend gloo``) runs
on gloo and the CPU on a GPU machine too, ``--device cuda`` (or ``--backend nccl``) insists
on a GPU.  NCCL runs on GPUs only, and gloo is used here on the CPU only, so ``--backend nccl
--device cpu`` and ``--backend gloo --device cuda`` are refused.

Which GPU.  Under dtrain's GPU binding (its default where a host has GPUs) every rank sees
only its own: dtrain sets ``CUDA_VISIBLE_DEVICES`` per rank to one GPU, or to K with
``--gpus-per-rank K``.  Without it (``--no-gpu-binding``, torchrun) every rank sees all of
its host's GPUs.  Either way a rank takes ``cuda:LOCAL_RANK`` when the GPUs it sees are
enough for one each of its host's ranks (``LOCAL_WORLD_SIZE``): all of them unbound, or its
own K bound; else, bound, it sees fewer than that, all its own, and takes the first,
``cuda:0``; unbound with fewer GPUs than ranks is refused (NCCL cannot put two ranks of a
group on one GPU).

``choose_device`` is that rule, pure and on the standard library alone (the examples check
their flags before torch loads); ``join_process_group`` applies it with torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cuda", "cpu")
BACKEND_OF = {"cuda": "nccl", "cpu": "gloo"}  # the one backend each kind of device runs here
DEVICE_OF = {"nccl": "cuda", "gloo": "cpu"}


class DeviceChoiceError(ValueError):
    """Flags that do not go together, or a GPU asked for that is not there: the message is
    one line, with how to fix it in parentheses."""


@dataclass(frozen=True)
class DeviceChoice:
    backend: str  # "nccl" or "gloo"
    device: str  # "cuda:N" or "cpu"


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="torch.distributed backend (default: nccl where CUDA is available, else gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=DEVICES, default="auto",
        help="where tensors live (default: cuda where CUDA is available, else cpu)",
    )  # fmt: skip


def check_flags(backend: str, device: str) -> str:
    """The kind of device the flags ask for ("cuda", "cpu", or "auto"); a pair that cannot
    run together is a DeviceChoiceError.  Needs no torch: bad flags are refused at once."""
    if backend not in BACKENDS or device not in DEVICES:
        raise DeviceChoiceError(
            f"unknown --backend {backend!r} or --device {device!r} "
            f"(use --backend {{{','.join(BACKENDS)}}} --device {{{','.join(DEVICES)}}})"
        )
    if backend != "auto" and device != "auto" and DEVICE_OF[backend] != device:
        raise DeviceChoiceError(
            f"--backend {backend} cannot run with --device {device}: {backend} runs on "
            f"{DEVICE_OF[backend]} tensors here (use --device {DEVICE_OF[backend]}, or "
            f"--backend {BACKEND_OF[device]}, or leave one of them out)"
        )
    if device != "auto":
        return device
    return DEVICE_OF[backend] if backend != "auto" else "auto"


def choose_device(
    environ: Mapping[str, str], cuda_device_count: int, backend: str = "auto", device: str = "auto"
) -> DeviceChoice:
    """The rank's backend and device, from its environment (``CUDA_VISIBLE_DEVICES``,
    ``LOCAL_RANK``), the CUDA devices torch sees and the flags (see the module's doc)."""
    kind = check_flags(backend, device)
    if kind == "auto":
        kind = "cuda" if cuda_device_count > 0 else "cpu"
    if kind == "cpu":
        return DeviceChoice("gloo", "cpu")
    forced = f"--device {device}" if device != "auto" else f"--backend {backend}"
    if cuda_device_count <= 0:
        raise DeviceChoiceError(
            f"{forced}, but torch sees no CUDA device here (torch.cuda.is_available() is "
            "false) (use --device cpu, or leave the flag out)"
        )
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_rank < cuda_device_count and local_world <= cuda_device_count:
        # a GPU each among those this host's ranks see: all of them (no binding, or a
        # CUDA_VISIBLE_DEVICES every rank shares), or the rank's own K (--gpus-per-rank K)
        return DeviceChoice("nccl", f"cuda:{local_rank}")
    if environ.get("CUDA_VISIBLE_DEVICES"):  # dtrain's binding: fewer than one per local rank
        return DeviceChoice("nccl", "cuda:0")  # seen, so these are the rank's own
    if local_rank >= cuda_device_count or local_world > cuda_device_count:
        raise DeviceChoiceError(
            f"LOCAL_RANK {local_rank} of {local_world}, but torch sees {cuda_device_count} "
            f"CUDA device(s) on this host: one GPU per rank (run at most {cuda_device_count} "
            "rank(s) per host, let dtrain bind the GPUs, or use --device cpu)"
        )
    return DeviceChoice("nccl", f"cuda:{local_rank}")


def refuse(message: str) -> NoReturn:
    """Bad input: one line on stderr, named after the example, and exit code 2."""
    print(f"{os.path.basename(sys.argv[0])}: {message}", file=sys.stderr)
    sys.exit(2)


def join_process_group(backend: str = "auto", device: str = "auto") -> tuple[str, torch.device]:
    """Choose the backend and device (bad flags or a missing GPU: ``refuse``), make the device
    the current one and join the process group from dtrain's (torchrun's) environment: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT.  Returns the backend and the device."""
    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        choice = choose_device(os.environ, count, backend, device)
    except DeviceChoiceError as exc:
        refuse(str(exc))
    where = torch.device(choice.device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
        # device_id: the group is bound to the rank's GPU (barriers and object collectives
        # use it, and NCCL connects the ranks now rather than at the first collective)
        dist.init_process_group(choice.backend, device_id=where)
    else:
        dist.init_process_group(choice.backend)
    return choice.backend, where
