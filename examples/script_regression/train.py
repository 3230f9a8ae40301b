"""A script-style job: ``python train.py --epochs 3``, run as ``__main__`` on every rank by Vigil.

A small MLP fits a noisy sine wave generated here. The script parses its own arguments and counts its
own steps; Vigil's rank API gives it the optimizer (the job spec's), per-step telemetry and
checkpoints. Submit with::

    vigil submit examples/script_regression/job.yaml --working-dir examples/script_regression

Outside Vigil (``python train.py``) the same script runs as one rank with a temporary checkpoint root.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from vigil import sdk as vigil


class Cursor:
    """Where this rank is in its data (epoch and batch), checkpointed with the model."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def main() -> None:
    p = argparse.ArgumentParser(description="Fit a noisy sine with an MLP.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches-per-epoch", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()

    run = vigil.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = vigil.optimizer(model, "adamw", lr=0.01)
    g = torch.Generator().manual_seed(1 + run.rank)
    xs = torch.rand(args.batches_per_epoch * args.batch_size, 1, generator=g) * 2 * math.pi
    ys = torch.sin(xs) + 0.05 * torch.randn(xs.shape, generator=g)
    cursor = Cursor()
    total = args.epochs * args.batches_per_epoch
    start = (vigil.restore(model=model, optimizer=opt, cursor=cursor) or 0) + 1
    for step in range(start, total + 1):
        with vigil.step(step) as s:
            with s.phase("data"):
                b = cursor.position % args.batches_per_epoch
                xb = xs[b * args.batch_size : (b + 1) * args.batch_size]
                yb = ys[b * args.batch_size : (b + 1) * args.batch_size]
                cursor.position += 1
            with s.phase("forward_backward"):
                opt.zero_grad()
                loss = nn.functional.mse_loss(opt.model(xb), yb)
                loss.backward()
            opt.step()
            s.report(loss=loss.item(), tokens=len(xb), epoch=(step - 1) // args.batches_per_epoch + 1)
        vigil.checkpoint(step, force=step == total, model=model, optimizer=opt, cursor=cursor)


if __name__ == "__main__":
    main()
