"""examples/devices.py: the backend and device the torch examples choose, by tables of the pure
rule (every GPU layout dtrain can give a rank, without a GPU), and its torch glue on a
machine without CUDA."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import pytest

from tests.conftest import REPO

if str(REPO / "examples") not in sys.path:  # as a rank's `python examples/X.py` has it
    sys.path.insert(0, str(REPO / "examples"))

from devices import DeviceChoice, DeviceChoiceError, choose_device

BOUND_1 = {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
BOUND_2 = {"CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def unbound(local_rank: int, local_world: int = 4) -> dict[str, str]:
    """--no-gpu-binding (or torchrun): no CUDA_VISIBLE_DEVICES, every GPU of the host seen."""
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)}


SHARED = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # --no-gpu-binding, a value every rank inherits


@pytest.mark.parametrize(
    ("environ", "gpus", "flags", "chosen"),
    [
        # dtrain's binding: the rank sees its own GPU(s) only: the first, or with enough
        # for one a local rank (--gpus-per-rank 2, 2 ranks a host) its LOCAL_RANK-th, its own
        (BOUND_1, 1, {}, DeviceChoice("nccl", "cuda:0")),
        (BOUND_2, 2, {}, DeviceChoice("nccl", "cuda:1")),
        (BOUND_2, 2, {"backend": "nccl", "device": "cuda"}, DeviceChoice("nccl", "cuda:1")),
        (
            {**BOUND_2, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"},
            2,
            {},
            DeviceChoice("nccl", "cuda:0"),
        ),
        # a CUDA_VISIBLE_DEVICES every rank inherits (no binding): LOCAL_RANK indexes it
        *[({**SHARED, **unbound(i)}, 4, {}, DeviceChoice("nccl", f"cuda:{i}")) for i in range(4)],
        # no binding: LOCAL_RANK picks one of the host's GPUs
        *[(unbound(i), 4, {}, DeviceChoice("nccl", f"cuda:{i}")) for i in range(4)],
        (unbound(1, 2), 2, {"device": "cuda"}, DeviceChoice("nccl", "cuda:1")),
        (unbound(1, 2), 2, {"backend": "nccl"}, DeviceChoice("nccl", "cuda:1")),
        ({}, 1, {}, DeviceChoice("nccl", "cuda:0")),  # plain `python X.py`: no LOCAL_RANK
        # no CUDA: gloo on the CPU, whatever the layout
        ({}, 0, {}, DeviceChoice("gloo", "cpu")),
        (unbound(3), 0, {}, DeviceChoice("gloo", "cpu")),
        (BOUND_1, 0, {"backend": "gloo"}, DeviceChoice("gloo", "cpu")),
        # the CPU asked for on a GPU host
        (BOUND_1, 1, {"device": "cpu"}, DeviceChoice("gloo", "cpu")),
        (unbound(2), 4, {"backend": "gloo"}, DeviceChoice("gloo", "cpu")),
        (unbound(9), 4, {"backend": "gloo", "device": "cpu"}, DeviceChoice("gloo", "cpu")),
    ],
)
def test_the_device_chosen(
    environ: Mapping[str, str], gpus: int, flags: dict[str, str], chosen: DeviceChoice
) -> None:
    assert choose_device(environ, gpus, **flags) == chosen


@pytest.mark.parametrize(
    ("environ", "gpus", "flags", "message"),
    [
        (
            unbound(1), 2, {},
            "LOCAL_RANK 1 of 4, but torch sees 2 CUDA device(s) on this host: one GPU per rank "
            "(run at most 2 rank(s) per host, let dtrain bind the GPUs, or use --device cpu)",
        ),
        (
            unbound(4), 4, {"backend": "nccl"},
            "LOCAL_RANK 4 of 4, but torch sees 4 CUDA device(s) on this host: one GPU per rank "
            "(run at most 4 rank(s) per host, let dtrain bind the GPUs, or use --device cpu)",
        ),
        (
            {}, 0, {"device": "cuda"},
            "--device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is "
            "false) (use --device cpu, or leave the flag out)",
        ),
        (
            BOUND_1, 0, {"backend": "nccl"},
            "--backend nccl, but torch sees no CUDA device here (torch.cuda.is_available() is "
            "false) (use --device cpu, or leave the flag out)",
        ),
        (
            BOUND_1, 1, {"backend": "nccl", "device": "cpu"},
            "--backend nccl cannot run with --device cpu: nccl runs on cuda tensors here (use "
            "--device cuda, or --backend gloo, or leave one of them out)",
        ),
        (
            {}, 0, {"backend": "gloo", "device": "cuda"},
            "--backend gloo cannot run with --device cuda: gloo runs on cpu tensors here (use "
            "--device cpu, or --backend nccl, or leave one of them out)",
        ),
        (
            {}, 0, {"backend": "mpi"},
            "unknown --backend 'mpi' or --device 'auto' "
            "(use --backend {auto,nccl,gloo} --device {auto,cuda,cpu})",
        ),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_saying_how_to_fix_it(
    environ: Mapping[str, str], gpus: int, flags: dict[str, str], message: str
) -> None:
    with pytest.raises(DeviceChoiceError) as refused:
        choose_device(environ, gpus, **flags)
    assert str(refused.value) == message


def test_a_gpu_asked_for_where_there_is_none_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The torch glue the examples call: torch's own answer, then the one line (no traceback)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from devices import join_process_group

    with pytest.raises(SystemExit) as ended:
        join_process_group("auto", "cuda")
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(
        ": --device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is "
        "false) (use --device cpu, or leave the flag out)\n"
    ), err
