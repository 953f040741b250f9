"""Pipeline (model) parallelism: one network's layers split over ranks, GPipe style.

    dtrain run -np 2 python examples/torch_pipeline_parallel.py
    dtrain run -np 4 -H h1:2,h2:2 python examples/torch_pipeline_parallel.py --stages 4
    dtrain run -np 2 python examples/torch_pipeline_parallel.py --engine torch
    python examples/torch_pipeline_parallel.py --single      # the one-process reference

The model is an MLP of ``--hidden-layers`` + 1 blocks (Linear+ReLU; the last one a Linear
alone).  Rank r holds stage r: a contiguous run of blocks and nothing else
(``--stages`` must equal WORLD_SIZE).  Each step takes a batch of 64 images, cuts it
into ``--micro-batches`` pieces and runs the GPipe schedule:

    forward   stage 0 computes micro-batch m and sends its activations to stage 1,
              which computes and sends to stage 2 ... ; the last stage computes the
              loss.  Stage 0 does not wait: it goes on with micro-batch m+1, so the
              stages work on different micro-batches at once (the pipeline).
    backward  the last stage backpropagates each micro-batch's loss and sends the
              gradient of its input back to the previous stage, which continues the
              backward pass through its own layers, and so on down to stage 0.
    update    every stage steps its own optimizer once, with the gradients
              accumulated over all micro-batches.

The loss of a micro-batch is weighted by its share of the batch, so the accumulated
gradient is the gradient of the whole batch: the pipeline makes the same updates as
ordinary training in one process.  ``--single`` is that training, in one process (on the CPU):
the same initial weights, data order and micro-batches (it computes exactly what the
pipeline computes: the same loss at every epoch, to the last printed digit), and with
``--micro-batches 1`` one backward pass per whole batch (the same up to floating-point
rounding).  Measured (15 epochs): test accuracy 0.9639 with 2 and with 4 stages, and
0.9639 for both one-process runs; the test suite allows 0.01 against whole batches.

``--engine p2p`` (default) does the schedule above by hand with torch.distributed's
point-to-point ``isend``/``recv``; ``--engine torch`` hands it to
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``), which does
the same over the same process group.  Both run over NCCL on GPUs where CUDA is available
(a GPU per rank), else over gloo on the CPU; ``--backend {auto,nccl,gloo}`` and ``--device
{auto,cuda,cpu}`` force either (devices.py says which GPU a rank takes, with dtrain's GPU
binding and with ``--no-gpu-binding``).  Bad input is refused (one line, exit code 2)
before torch loads.

The environment is dtrain's (torchrun's) contract: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK.  The data is scikit-learn's handwritten digits (8x8 images,
10 classes, shipped with the package: no download), split as in
torch_ddp_checkpoint.py.  The last stage prints ``test accuracy: 0.9xxx``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Mapping

from devices import DeviceChoiceError, add_device_flags, check_flags, join_process_group, refuse

BATCH = 64
SEED = 0
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=None, help="default: WORLD_SIZE")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden-layers", type=int, default=3, help="the model has 1 more blocks")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--engine", choices=["p2p", "torch"], default="p2p")
    parser.add_argument("--single", action="store_true", help="train in one process (reference)")
    add_device_flags(parser)
    return parser.parse_args()


def input_error(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """What is wrong with the arguments and the environment, if anything (the standard
    library only: it runs before torch loads, so bad input is refused at once)."""
    blocks = args.hidden_layers + 1
    if args.hidden_layers < 0 or args.micro_batches < 1 or args.epochs < 1:
        return "--hidden-layers must be 0 or more, --micro-batches and --epochs 1 or more"
    if BATCH % args.micro_batches:
        return f"--micro-batches {args.micro_batches} does not divide the batch ({BATCH}): use 4"
    try:
        check_flags(args.backend, args.device)
    except DeviceChoiceError as exc:
        return str(exc)
    if args.single:
        return None
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return "RANK and WORLD_SIZE are not set: run it with dtrain run -np 2, or with --single"
    world = int(environ["WORLD_SIZE"])
    stages = world if args.stages is None else args.stages
    if stages != world:
        return f"--stages {stages} but WORLD_SIZE is {world}: one stage per rank, use -np {stages}"
    if stages < 2:
        return "a pipeline needs 2 stages or more: -np 2 or more (or --single for one process)"
    if stages > blocks:
        return (
            f"{stages} stages but the model has {blocks} blocks: use --hidden-layers {stages - 1}"
        )
    return None


if __name__ == "__main__":  # checked before the imports below: torch takes seconds to load
    ARGS = parse_args()
    if (error := input_error(ARGS, os.environ)) is not None:
        refuse(error)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: E402


def load_data() -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.2, random_state=0
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def build_blocks(hidden_layers: int) -> list[nn.Module]:
    """The whole model as a list of blocks, with the same initial weights in every process."""
    torch.manual_seed(SEED)
    widths = [64] + [128] * hidden_layers + [10]
    blocks: list[nn.Module] = []
    for i in range(len(widths) - 1):
        linear = nn.Linear(widths[i], widths[i + 1])
        last = i == len(widths) - 2
        blocks.append(linear if last else nn.Sequential(linear, nn.ReLU()))
    return blocks


def stage_of(blocks: list[nn.Module], stage: int, stages: int) -> nn.Sequential:
    """Stage ``stage``'s contiguous share of the blocks (the first stages get any extra one)."""
    per, extra = divmod(len(blocks), stages)
    start = stage * per + min(stage, extra)
    return nn.Sequential(*blocks[start : start + per + (stage < extra)])


def batches(epoch: int, count: int) -> list[torch.Tensor]:
    """The sample indexes of each step of ``epoch``: one seeded shuffle, the same everywhere."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(1000 + epoch))
    return [order[i : i + BATCH] for i in range(0, count - BATCH + 1, BATCH)]


def in_features(module: nn.Module) -> int:
    return next(m for m in module.modules() if isinstance(m, nn.Linear)).in_features


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


def train_single(args: argparse.Namespace) -> int:
    """The reference: the identical model, initial weights and data order in one process,
    accumulating the gradients of the same micro-batches (``--micro-batches 1``: whole batches)."""
    x_train, y_train, x_test, y_test = load_data()
    model = nn.Sequential(*build_blocks(args.hidden_layers))
    optimizer = make_optimizer(model)
    for epoch in range(args.epochs):
        losses = []
        for batch in batches(epoch, len(x_train)):
            optimizer.zero_grad()
            loss = 0.0
            for part in batch.tensor_split(args.micro_batches):
                weight = len(part) / len(batch)  # as the pipeline's last stage weighs it
                part_loss = (
                    nn.functional.cross_entropy(model(x_train[part]), y_train[part]) * weight
                )
                part_loss.backward()
                loss += part_loss.item()
            optimizer.step()
            losses.append(loss)
        print(f"epoch {epoch + 1} mean loss {sum(losses) / len(losses):.6f}")
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"test accuracy: {accuracy:.4f} (single process)")
    return 0


class Pipeline:
    """This rank's stage and its neighbours in the pipeline."""

    def __init__(self, module: nn.Module, rank: int, stages: int, device: torch.device) -> None:
        self.module, self.rank, self.stages, self.device = module.to(device), rank, stages, device
        self.first, self.last = rank == 0, rank == stages - 1
        self.width_in = in_features(module)  # the size of one activation this stage receives

    def receive(self, rows: int, width: int, source: int) -> torch.Tensor:
        buffer = torch.empty(rows, width, device=self.device)
        dist.recv(buffer, src=source)
        return buffer

    def train_step(self, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> float | None:
        """One GPipe step by hand: all forwards, then all backwards.  Returns the batch's loss
        on the last stage, None on the others."""
        xs, ys = x.tensor_split(micro_batches), y.tensor_split(micro_batches)
        inputs, outputs, sends = [], [], []  # the last stage's outputs are its (weighted) losses
        for m in range(micro_batches):  # forward: activations flow up the pipeline
            if self.first:
                inp = xs[m].to(self.device)
            else:
                inp = self.receive(len(ys[m]), self.width_in, self.rank - 1).requires_grad_()
            out = self.module(inp)
            if self.last:  # weighted by its share of the batch: the sum is the batch's loss
                out = nn.functional.cross_entropy(out, ys[m].to(self.device)) * len(ys[m]) / len(y)
            else:
                sends.append(dist.isend(out.detach(), dst=self.rank + 1))
            inputs.append(inp)
            outputs.append(out)
        for m in range(micro_batches):  # backward: gradients flow down the pipeline
            if self.last:
                outputs[m].backward()  # grads accumulate in .grad over the micro-batches
            else:
                grad = self.receive(len(ys[m]), outputs[m].shape[1], self.rank + 1)
                outputs[m].backward(grad)
            if not self.first:
                sends.append(dist.isend(inputs[m].grad, dst=self.rank - 1))
        for request in sends:
            request.wait()
        return sum(loss.item() for loss in outputs) if self.last else None

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward the test set through the stages; the last one returns the accuracy."""
        with torch.no_grad():
            if self.first:
                inp = x.to(self.device)
            else:
                inp = self.receive(len(y), self.width_in, self.rank - 1)
            out = self.module(inp)
            if not self.last:
                dist.send(out, dst=self.rank + 1)
                return None
            return (out.argmax(1).cpu() == y).float().mean().item()


def torch_schedule(pipe: Pipeline, micro_batches: int) -> ScheduleGPipe:
    """The same GPipe schedule from torch.distributed.pipelining (it averages the
    micro-batches' gradients: equal micro-batches give the whole batch's gradient)."""
    stage = PipelineStage(pipe.module, pipe.rank, pipe.stages, pipe.device)
    return ScheduleGPipe(stage, n_microbatches=micro_batches, loss_fn=nn.functional.cross_entropy)


def train_pipeline(args: argparse.Namespace) -> int:
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE: the rendezvous dtrain chose
    backend, device = join_process_group(args.backend, args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = load_data()
    blocks = build_blocks(args.hidden_layers)
    sizes = ", ".join(str(len(stage_of(blocks, s, world))) for s in range(world))
    pipe = Pipeline(stage_of(blocks, rank, world), rank, world, device)
    del blocks  # the other stages' layers: this rank keeps its own only
    optimizer = make_optimizer(pipe.module)
    schedule = torch_schedule(pipe, args.micro_batches) if args.engine == "torch" else None
    held = sum(p.numel() for p in pipe.module.parameters())
    print(f"stage {rank}: {len(pipe.module)} block(s), {held} parameters, on {device} ({backend})")
    if pipe.last:
        print(f"{world} stages (blocks per stage: {sizes}), {args.micro_batches} micro-batches")
    for epoch in range(args.epochs):
        losses = []  # the last stage's loss of each batch
        for batch in batches(epoch, len(x_train)):
            optimizer.zero_grad()
            x, y = x_train[batch], y_train[batch]
            if schedule is None:
                losses.append(pipe.train_step(x, y, args.micro_batches))
            elif pipe.first:
                schedule.step(x.to(device))
            else:
                per_micro_batch: list[torch.Tensor] = []
                target = y.to(device) if pipe.last else None
                schedule.step(target=target, losses=per_micro_batch)
                losses.append(sum(t.item() for t in per_micro_batch) / args.micro_batches)
            optimizer.step()
        if pipe.last:
            print(f"epoch {epoch + 1} mean loss {sum(losses) / len(losses):.6f}")
    accuracy = pipe.evaluate(x_test, y_test)
    if pipe.last:
        print(f"test accuracy: {accuracy:.4f} (pipeline, {world} stages)")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(args: argparse.Namespace) -> int:
    """Train (``args`` checked by ``input_error``)."""
    return train_single(args) if args.single else train_pipeline(args)


if __name__ == "__main__":
    exit_code = main(ARGS)
    # Python's last garbage collection at exit walks every torch object (about a second of
    # CPU per process); nothing in that garbage needs cleaning up: skip it.
    gc.freeze()
    sys.exit(exit_code)
