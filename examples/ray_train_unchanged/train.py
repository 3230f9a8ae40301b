"""A Ray Train training function as Ray Train's own documentation writes it: no Vigil import anywhere.

    vigil submit examples/ray_train_unchanged/job.yaml --working-dir examples/ray_train_unchanged

``train_loop_per_worker(config)`` prepares its model and data loader with ``ray.train.torch``, restores
from ``ray.train.get_checkpoint()`` and reports metrics and checkpoints with ``ray.train.report``. The
same function runs under a plain ``TorchTrainer``. Under Vigil every rank's steps (torch's optimizer
step delimits them), DDP's collectives (torch's Flight Recorder), stragglers and hangs are watched, and
a failed rank restarts the group, which resumes from the function's own Ray Train checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    y = (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()
    return TensorDataset(x, y)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(make_dataset(config.get("samples", 8192), 0), batch_size=config.get("batch_size", 64), shuffle=True))

    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])

    rank = ray.train.get_context().get_world_rank()
    steps, every = int(config.get("steps", 200)), int(config.get("checkpoint_every", 50))
    epoch = 0
    while step < steps:
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % every == 0 or step == steps:
                with tempfile.TemporaryDirectory() as folder:
                    ckpt = None
                    if rank == 0:
                        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                    "step": step}, os.path.join(folder, "state.pt"))
                        ckpt = ray.train.Checkpoint.from_directory(folder)
                    ray.train.report({"loss": loss.item(), "step": step}, checkpoint=ckpt)
            if step >= steps:
                break
        epoch += 1
