"""A trial for dtrain sweep: an MLP learns scikit-learn's digits, reporting its metrics.

    dtrain sweep --grid 'lr=0.3,0.1,0.03 hidden=16,64' -H localhost:3 --objective val_acc \\
        --maximize python examples/sweep_train.py --lr {lr} --hidden {hidden}
    dtrain sweep --random 8 --param 'lr=loguniform(1e-3,1)' --param 'hidden=int(8,128)' \\
        --seed 1 --objective val_acc --maximize python examples/sweep_train.py --lr {lr} \\
        --hidden {hidden}

The digits (1797 8x8 images, shipped with scikit-learn: no download) are split
once, with a fixed seed, into 1437 for training and 360 for validation; an MLP
with one hidden layer of ``--hidden`` units trains with SGD (``--lr``,
momentum 0.9) in mini-batches of ``--batch`` for ``--epochs`` epochs.  After
every epoch it prints ``metric: epoch=N loss=... val_acc=...`` (the sweep's
table keeps the last value of each), and at the end also writes them as a JSON
line to ``$DTRAIN_METRICS_FILE`` when dtrain sets it.  One thread, so that
trials side by side do not fight over cores.

The same command gives the same figures whatever vector instructions the CPU
has: the seeds fix the weights and the order of the batches, and the model
computes in float64.  In float32 the result depended on them (torch and MKL sum
in another order with AVX-512, AVX2 or none), and a high learning rate amplifies
that over 15 epochs: ``--lr 0.3 --hidden 16`` ended at 0.9333 on one machine and
0.9417 on another.  (Each kind was tried on one machine, with
``ATEN_CPU_CAPABILITY`` and ``MKL_CBWR``: in float64 all gave the same figures.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLIT_SEED = 0  # the same validation set for every trial


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    return parser.parse_args()


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float64) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=0.2, random_state=SPLIT_SEED, stratify=y
    )
    return x_train, y_train, x_val, y_val


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # the same figures whatever the CPU (above)
    torch.manual_seed(args.seed)
    x_train, y_train, x_val, y_val = load_data()
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(args.seed)
    metrics: dict[str, float] = {}
    for epoch in range(1, args.epochs + 1):
        model.train()
        total = 0.0
        for batch in torch.randperm(len(x_train), generator=order).split(args.batch):
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        model.eval()
        with torch.no_grad():
            val_acc = (model(x_val).argmax(1) == y_val).float().mean().item()
        metrics = {"epoch": epoch, "loss": total / len(x_train), "val_acc": val_acc}
        print(f"metric: epoch={epoch} loss={metrics['loss']:.4f} val_acc={val_acc:.4f}", flush=True)
    path = os.environ.get("DTRAIN_METRICS_FILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"final_val_acc": round(metrics["val_acc"], 4)}) + "\n")


if __name__ == "__main__":
    main()
    # Python's last garbage collection at exit walks every torch object (about a second of
    # CPU per process); nothing in that garbage needs cleaning up: skip it.
    gc.freeze()
