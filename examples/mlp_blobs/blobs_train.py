"""An MLP classifier on generated Gaussian blobs: a user's own model, data and loop on Vigil's rank API.

Copy this folder to start your own project. Submit it with::

    vigil submit examples/mlp_blobs/job.yaml --working-dir examples/mlp_blobs

The entry point (``entrypoint: blobs_train:train_func`` in job.yaml) is called on every rank with the
job's ``config``. Nothing here is Vigil's but the ``vigil.*`` calls: the optimizer (any kind, taken
from the job spec), the step marking, the report and the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vigil import sdk as vigil


@dataclass(frozen=True)
class BlobsConfig:
    """This example's ``config`` (job.yaml), checked once."""

    classes: int = 4
    features: int = 16
    hidden: int = 64
    samples: int = 4096
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("classes", "features", "hidden", "samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name} must be >= 1, got {getattr(self, name)}")


def make_blobs(cfg: BlobsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` points around ``classes`` random centres (the same on every rank for a seed)."""
    g = torch.Generator().manual_seed(cfg.seed)
    centres = torch.randn(cfg.classes, cfg.features, generator=g) * 3.0
    labels = torch.randint(0, cfg.classes, (cfg.samples,), generator=g)
    points = centres[labels] + torch.randn(cfg.samples, cfg.features, generator=g)
    return points, labels


class Batches:
    """This rank's shard of the data in a fixed shuffled order; its position is checkpointed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int) -> None:
        self.x, self.y = x[rank::world_size], y[rank::world_size]
        self.batch_size = batch_size
        self.index = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.x.shape[0]
        start = (self.index * self.batch_size) % max(1, n - self.batch_size)
        self.index += 1
        return self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def train_func(config: dict[str, Any]) -> None:
    run = vigil.init()
    cfg = BlobsConfig(**config)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(cfg.features, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.classes))
    opt = vigil.optimizer(model)
    x, y = make_blobs(cfg)
    data = Batches(x, y, cfg.batch_size, run.rank, run.world_size)
    loss_fn = nn.CrossEntropyLoss()
    start = (vigil.restore(model=model, optimizer=opt, data=data) or 0) + 1
    for step in range(start, run.steps + 1):
        with vigil.step(step) as s:
            with s.phase("data"):
                xb, yb = data.next()
            with s.phase("forward_backward"):
                opt.zero_grad()
                logits = opt.model(xb)
                loss = loss_fn(logits, yb)
                loss.backward()
            opt.step()
            accuracy = (logits.argmax(dim=1) == yb).float().mean().item()
            s.report(loss=loss.item(), tokens=len(xb), accuracy=accuracy)
        vigil.checkpoint(step, model=model, optimizer=opt, data=data)
