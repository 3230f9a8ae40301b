"""A torchrun script, exactly as one is written for torchrun: no Vigil import anywhere.

    torchrun --nproc-per-node 2 train.py --steps 200    # without Vigil
    vigil submit examples/torchrun_script/job.yaml --working-dir examples/torchrun_script

Under Vigil each rank runs this file as its own process with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); the script makes its own process group, wraps its model in DDP,
steps torch's AdamW and keeps its own checkpoint. Vigil still sees every step (torch's optimizer step
delimits them), every DDP all-reduce (torch's Flight Recorder), a rank that is slow or hung, and
restarts the ranks after a failure; the script resumes from its own checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser(description="Fit y = sin(3x) with an MLP under DDP.")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    # Where the script keeps its checkpoint: a folder every rank's node sees. Under Vigil, the job's own
    # folder on shared storage (VIGIL_JOB_DIR), the same after a restart; else ./checkpoints.
    p.add_argument("--checkpoint-dir", default=os.path.join(os.environ.get("VIGIL_JOB_DIR", "."), "checkpoints"))
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step (data loading)")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops at --hang-step (a test of hangs)")
    p.add_argument("--hang-step", type=int, default=-1)
    args = p.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                                  nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = Path(args.checkpoint_dir) / "last.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"rank {rank}: resumed from step {start}", flush=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(start + 1, args.steps + 1):
        if rank == args.hang_rank and step == args.hang_step:
            time.sleep(3600)
        time.sleep(args.step_delay)
        x = torch.rand(args.batch_size, 1, generator=g) * 2 - 1
        y = torch.sin(3 * x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % args.checkpoint_every == 0 or step == args.steps:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)  # a reader never sees half a file
            dist.barrier()
        if step % 50 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
