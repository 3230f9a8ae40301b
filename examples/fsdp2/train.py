"""FSDP2 as PyTorch writes it: ``fully_shard`` on a device mesh, torch's AdamW, a loop of one's own.

Vigil is three calls here (``init``, ``step``, ``report``); the sharded model and optimizer are saved
by the code itself with ``torch.distributed.checkpoint`` (each rank writes its shards; a restart loads them
back, on any world size) into the job's folder on shared storage (``VIGIL_JOB_DIR``). FSDP2's all-gathers
of parameters and its gradient reductions are torch's own; Vigil reads them from torch's Flight Recorder.
It runs on CPU with gloo here (torch 2.13 shards on a ``cpu`` mesh); on GPUs, the same code on a ``cuda``
mesh and NCCL.

    vigil submit examples/fsdp2/job.yaml --working-dir examples/fsdp2
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import vigil


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    """A small residual MLP regressor: ``blocks`` blocks of ``width``."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class Batches:
    """Generated regression data (y = sum of sines), this rank's stream; its position is checkpointed."""

    def __init__(self, rank: int, batch_size: int) -> None:
        self.rank, self.batch_size, self.index = rank, batch_size, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + self.index)
        self.index += 1
        x = torch.randn(self.batch_size, 4, generator=g)
        return x, torch.sin(2 * x).sum(dim=1, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def save(folder: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, data: Batches) -> None:
    """Every rank writes its shards to ``step-N``; then rank 0 points ``latest`` at it (a crash mid-save
    leaves the previous one in force)."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step), "data": torch.tensor(data.index)},
             checkpoint_id=str(folder / f"step-{step}"))
    dist.barrier()
    if dist.get_rank() == 0:
        (folder / "latest.tmp").write_text(f"step-{step}")
        os.replace(folder / "latest.tmp", folder / "latest")
        for old in sorted(folder.glob("step-*"), key=lambda p: int(p.name[5:]))[:-2]:  # keep the newest two
            shutil.rmtree(old, ignore_errors=True)


def load(folder: Path, model: nn.Module, opt: torch.optim.Optimizer, data: Batches) -> int:
    """The step of the newest complete checkpoint loaded into the model, optimizer and data; 0: none."""
    if not (folder / "latest").is_file():
        return 0
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0), "data": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(folder / (folder / "latest").read_text().strip()))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    data.index = int(state["data"])
    return int(state["step"])


def train_func(config: dict[str, Any]) -> None:
    run = vigil.init()
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (run.world_size,))
    torch.manual_seed(0)
    model = Net(int(config.get("width", 64)), int(config.get("blocks", 2)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # each block's parameters gathered only while it runs
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 1e-3)))
    data = Batches(run.rank, int(config.get("batch_size", 32)))
    folder = Path(os.environ.get("VIGIL_JOB_DIR", ".")) / "fsdp2-checkpoints"
    every = int(config.get("checkpoint_every", 40))
    start = load(folder, model, opt, data) + 1
    load_s = float(config.get("load_s", 0.0))  # a data loader's time per batch (to watch a long run)
    stall = config.get("stall") or {}  # {rank, step}: that rank stops in this loop (to see a hang found)
    for step in range(start, run.steps + 1):
        with vigil.step(step):
            if run.rank == stall.get("rank") and step == stall.get("step"):
                time.sleep(float(stall.get("seconds", 3600)))
            time.sleep(load_s)
            x, y = data.next()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # FSDP2 reduces the gradients shard by shard here
            opt.step()
            opt.zero_grad()
            vigil.report(loss=loss.item(), tokens=len(x))
        if step % every == 0 or step == run.steps:
            save(folder, step, model, opt, data)
