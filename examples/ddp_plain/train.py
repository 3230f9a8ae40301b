"""Plain PyTorch DDP, as a user already has it: torch's DistributedDataParallel and AdamW, a loop of one's own.

Vigil is four calls here (``init``, ``step``, ``report``, ``checkpoint`` / ``restore``); the gradients go
through torch's own DDP, not Vigil's optimizer, and Vigil still sees every collective: it reads them
from torch's Flight Recorder (each DDP bucket's all-reduce: op, group, sizes, when it was enqueued, the
wait of each rank), so stragglers, hangs and bytes on the wire show as for Vigil's own optimizers
(bytes marked as estimated). Submit with::

    vigil submit examples/ddp_plain/job.yaml --working-dir examples/ddp_plain
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import vigil


class Batches:
    """This rank's shard of generated two-spirals data, in order; its position is checkpointed."""

    def __init__(self, rank: int, world_size: int, samples: int, batch_size: int, seed: int,
                 load_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        t = torch.rand(samples, generator=g) * 12.0
        label = torch.randint(0, 2, (samples,), generator=g)
        sign = label.float() * 2 - 1
        x = torch.stack([sign * t.cos() * t, sign * t.sin() * t], dim=1) / 12.0
        x = x + 0.02 * torch.randn(samples, 2, generator=g)
        self.x, self.y = x[rank::world_size], label[rank::world_size]
        self.batch_size = batch_size
        self.load_s = load_s
        """Seconds a batch takes to load (a slow disk or a remote store)."""
        self.index = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.load_s:
            time.sleep(self.load_s)
        start = (self.index * self.batch_size) % max(1, len(self.x) - self.batch_size)
        self.index += 1
        return self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def train_func(config: dict[str, Any]) -> None:
    run = vigil.init()  # Ray Train made the process group; Vigil opened this rank's session
    torch.manual_seed(0)  # the same initial weights on every rank
    width = int(config.get("width", 128))
    net = nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 3e-3)))
    data = Batches(run.rank, run.world_size, int(config.get("samples", 8192)), int(config.get("batch_size", 64)), 0,
                   float(config.get("load_s", 0.0)))
    start = (vigil.restore(model=net, optimizer=opt, data=data) or 0) + 1
    stall = config.get("stall") or {}  # {rank, step}: that rank stops in this loop (to see a hang found)
    for step in range(start, run.steps + 1):
        with vigil.step(step):
            if run.rank == stall.get("rank") and step == stall.get("step"):
                time.sleep(float(stall.get("seconds", 3600)))
            x, y = data.next()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            opt.step()
            vigil.report(loss=loss.item(), tokens=len(x))
        vigil.checkpoint(step, model=net, optimizer=opt, data=data)
