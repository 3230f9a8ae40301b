"""A user's loop for the live-recovery tests: the MLP-on-blobs example's model and data, and after every
step one JSON line per rank (pid, time, loss, a hash of the parameters' bytes) in ``config["out"]``;
``config["stall"]`` (``{rank, step}``) makes that rank fall asleep inside that step (a line ``stalled_at`` first)."""

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
    stall = config.get("stall") or {}  # {rank, step}: that rank falls asleep in this loop (a hang of the user's own)
    with (out / f"rank{run.rank}.jsonl").open("a") as f:
        for step in range(start, run.steps + 1):
            with vigil.step(step) as s:
                if run.rank == stall.get("rank") and step == stall.get("step") and start < step:
                    f.write(json.dumps({"rank": run.rank, "pid": os.getpid(), "stalled_at": step, "ts": time.time()}) + "\n")
                    f.flush()
                    # (its replacement heals to the step before and runs this one again: not asleep then)
                    time.sleep(float(stall.get("seconds", 3600)))
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
