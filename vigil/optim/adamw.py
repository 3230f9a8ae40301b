"""Baseline: DDP with AdamW. Gradients are averaged by an fp32 all-reduce every step (32 b/p/step)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vigil.comm import Comm
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import Strategy, clip_grad
from vigil.optim.flat import broadcast_module


class DDPAdamW(Strategy):
    """Gradient all-reduce through the communication layer, then a plain AdamW step.

    The all-reduce goes through :class:`Comm` (not DDP's reducer) so every byte is timed and counted.
    """

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        super().__init__(model, comm)
        self.spec = spec
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
        self._params = [p for p in model.parameters() if p.requires_grad]
        # Start from identical weights on every rank (through the layer: timed and counted, tag init).
        broadcast_module(model, comm)

    def step(self, step: int, lr: float) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, tag="grads")
        flat.div_(self.comm.world_size)
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        clip_grad(self.module, self.spec.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
