"""The optimizers on a GPU: PyTorch's DDP communication hooks on NCCL, and every kind on CUDA tensors.

Needs: a CUDA GPU (skipped without one, with that reason; CI's machine has none, so these run on a lent
GPU: tests/device/check_gpu.sh). One process, one NCCL rank on cuda:0 (one GPU holds one NCCL rank), on a
free port of 127.0.0.1. On a world of one, DDP still runs its hook on every bucket (the NCCL all-reduces
are real); Vigil's own communication layer skips the call in a group of one, so for the other kinds
this checks their arithmetic on the GPU (device placement, the quantisers' kernels), not their traffic.
The 2-rank gloo counterparts are in tests/vigil/optim/.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.vigil.optim.common import batch, bits_per_element, make, roundtrip, tiny_mlp
from vigil.contract.probe import free_port
from vigil.optim import REGISTRY
from vigil.optim.base import Strategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
PARAMS = 212
"""tiny_mlp's parameters (8-16-4)."""


@pytest.fixture(scope="module")
def nccl() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(strategy: Strategy, dev: str, steps: int) -> tuple[list[float], list[Any]]:
    """``steps`` steps on one fixed batch (the loss must fall): the losses and the records of each step."""
    x, y = (t.to(dev) for t in batch(0, 0))
    losses, records = [], []
    for step in range(steps):
        strategy.comm.set_step(step)
        strategy.zero_grad()
        loss = F.mse_loss(strategy.model(x), y)
        loss.backward()
        strategy.step(step, 1e-2)
        losses.append(float(loss.detach()))
        records.append(strategy.comm.drain())
    return losses, records


def _falls(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def half_compress(dev: str) -> dict[str, Any]:
    strategy = make("fp16_compress", tiny_mlp().to(dev))
    strategy.comm.drain()
    losses, records = train(strategy, dev, 8)
    flat = [r for recs in records for r in recs]
    return {"hook": strategy.hook.__name__, "losses": losses, "bits": bits_per_element(flat, "grads"),
            "calls": sum(r.tag == "grads" for r in flat), "durations": [r.duration_s for r in flat if r.tag == "grads"],
            "devices": {str(p.device) for p in strategy.module.parameters()}}


def test_half_compress_on_nccl_sends_bf16_and_trains(nccl: None) -> None:
    out = half_compress("cuda")
    assert out["hook"] == "bf16_compress_hook"  # NCCL: bf16, as HalfCompress picks it
    assert out["calls"] >= 8 and out["bits"] == 16.0  # a counted hook call per bucket and step
    assert all(d > 0 for d in out["durations"])
    assert _falls(out["losses"]), out["losses"]
    assert out["devices"] == {"cuda:0"}


START = 3


def powersgd(dev: str) -> dict[str, Any]:
    strategy = make("powersgd", tiny_mlp().to(dev), rank=1, start_iter=START)
    strategy.comm.drain()
    losses, records = train(strategy, dev, 8)
    s = strategy.hook_state
    state = roundtrip(strategy.state_dict())  # what a checkpoint holds, read back
    again = make("powersgd", tiny_mlp(seed=1).to(dev), rank=1, start_iter=START)
    again.load_state_dict(state)
    return {
        "per_step": [sum(r.payload_bytes for r in recs if r.tag == "grads") for recs in records], "losses": losses,
        "memories": {str(t.device) for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict) for t in d.values()},
        "loaded": {str(t.device) for t in again.hook_state.error_dict.values()},
        "next": train(again, dev, 1)[0],
    }


def test_powersgd_on_nccl_compresses_after_its_start_and_trains(nccl: None) -> None:
    out = powersgd("cuda")
    per_step = out["per_step"]
    assert per_step[:START] == [4 * PARAMS] * START  # fp32 all-reduce before start_iter
    assert all(0 < b < 4 * PARAMS for b in per_step[START:]), per_step  # then P, Q and the vectors
    assert _falls(out["losses"]), out["losses"]
    assert out["memories"] == {"cuda:0"}  # error feedback and warm start live on the GPU
    assert out["loaded"] <= {"cuda:0"} and all(math.isfinite(v) for v in out["next"])


def every_kind(kind: str, dev: str) -> dict[str, Any]:
    strategy = make(kind, tiny_mlp().to(dev))
    losses, _ = train(strategy, dev, 8)
    state = roundtrip(strategy.state_dict())
    again = make(kind, tiny_mlp(seed=1).to(dev))
    again.load_state_dict(state)
    return {"losses": losses, "devices": {str(p.device) for p in strategy.module.parameters()},
            "next": train(again, dev, 1)[0]}


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_kind_trains_a_model_on_the_gpu(nccl: None, kind: str) -> None:
    out = every_kind(kind, "cuda")
    assert _falls(out["losses"]), out["losses"]
    assert out["devices"] == {"cuda:0"}
    assert all(math.isfinite(v) for v in out["next"])  # its state saved and loaded back on the GPU
