"""Tiny models, per-rank data and step loops shared by the optimizer tests (no process group needed here)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vigil.comm import Comm
from vigil.contract.schemas import OptimizerSpec
from vigil.optim import build_strategy
from vigil.optim.base import Strategy

IN, HIDDEN, OUT = 8, 16, 4
"""MLP 8-16-4: 212 parameters (a multiple of 4, so shards need no padding on 2 or 4 ranks)."""


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A different, reproducible batch per (rank, step): ranks really disagree between syncs."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(16, IN, generator=g)
    y = torch.randn(16, OUT, generator=g) + rank
    return x, y


def make(kind: str, model: nn.Module, comm: Comm | None = None, *, lr: float = 1e-2, weight_decay: float = 0.0,
         grad_clip: float = 0.0, **params: Any) -> Strategy:
    spec = OptimizerSpec(kind=kind, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, params=params)
    return build_strategy(spec, model, comm if comm is not None else Comm.from_process_group())


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def train_step(strategy: Strategy, rank: int, step: int, lr: float = 1e-2, seed: int = 0) -> float:
    strategy.comm.set_step(step)
    strategy.zero_grad()
    x, y = batch(rank, step, seed)
    loss = F.mse_loss(strategy.model(x), y)
    loss.backward()
    strategy.step(step, lr)
    return float(loss.detach())


def roundtrip(state: Any) -> Any:
    """``state`` through ``torch.save`` / ``torch.load(weights_only=True)``, as a checkpoint sees it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def payload_bits_per_param_step(records: list[Any], params: int, steps: int, tags: set[str] | None = None) -> float:
    bits = sum(8 * r.payload_bytes for r in records if tags is None or r.tag in tags)
    return bits / (params * steps)


def bits_per_element(records: list[Any], tag: str) -> float:
    rs = [r for r in records if r.tag == tag]
    return sum(8 * r.payload_bytes for r in rs) / sum(r.elements for r in rs)
