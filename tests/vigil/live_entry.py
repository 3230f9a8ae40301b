"""A user's loop for the live-recovery tests: the MLP-on-blobs example's model and data, and after every
step one JSON line per rank (pid, time, loss, a hash of the parameters' bytes) in ``config["out"]``."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from examples.mlp_blobs.blobs_train import Batches, BlobsConfig, make_blobs
from vigil import sdk as vigil


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_func(config: dict[str, Any]) -> None:
    run = vigil.init()
    out = Path(config["out"])
    sleep_s = float(config.get("step_sleep_s", 0.0))
    cfg = BlobsConfig(**{k: v for k, v in config.items() if k in BlobsConfig.__dataclass_fields__})
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(cfg.features, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.classes))
    opt = vigil.optimizer(model)
    x, y = make_blobs(cfg)
    data = Batches(x, y, cfg.batch_size, run.rank, run.world_size)
    loss_fn = nn.CrossEntropyLoss()
    start = (vigil.restore(model=model, optimizer=opt, data=data) or 0) + 1
    with (out / f"rank{run.rank}.jsonl").open("a") as f:
        for step in range(start, run.steps + 1):
            with vigil.step(step) as s:
                xb, yb = data.next()
                opt.zero_grad()
                loss = loss_fn(opt.model(xb), yb)
                loss.backward()
                opt.step()
                s.report(loss=loss.item(), tokens=len(xb))
            vigil.checkpoint(step, model=model, optimizer=opt, data=data)
            f.write(json.dumps({"rank": run.rank, "pid": os.getpid(), "step": step, "ts": time.time(),
                                "loss": loss.item(), "params": params_hash(model), "start": start}) + "\n")
            f.flush()
            if sleep_s:
                time.sleep(sleep_s)
