"""DSM-LS: distributed sign momentum with local steps (Yu, Zhou, Xie et al., arXiv 2411.17866).

ALGORITHMS.md §1. Every step each rank takes a local AdamW step (its m, v stay local, never
averaged or reset). Every ``tau`` local steps::

    x_avg = mean_i x_i                     # reduce-scatter to shard owners (or one all-reduce)
    d     = (x_old - x_avg) / lr_t         # pseudo-gradient; lr_t = the current local learning rate
    c     = beta1*m + (1-beta1)*d
    x_old = x_old*(1 - gamma*lr_t*wd) - gamma*lr_t*sign(c)     # decoupled weight decay, sign step
    m     = beta2*m + (1-beta2)*d
    every x_i <- x_old                     # all-gather of the updated shards

Choices, and where they differ from the reference (shuhuayu/dist-sign-momentum, a fairscale fork):

* The global state (x_old, m) is fp32 and sharded 1/N: rank r owns elements [r*S/N, (r+1)*S/N) of
  the zero-padded flat model (the reference shards the same way, but communicates with N reduces and
  N broadcasts; here one reduce-scatter and one all-gather). ``sharded=False`` keeps the state
  replicated and uses one all-reduce (32/tau b/p/step payload; sharded: 32/tau*(1+1/N) payload
  counted by :mod:`vigil.comm`, identical wire bytes).
* x_old is taken from the weights at the start of the first :meth:`step` call (identical on every
  rank); the reference copies each owner's weights after its first local step.
* The sign step is evaluated as ``x_avg + lr*(d - gamma*(s + wd*x_old))``, algebraically equal to
  the rule above (lr*d = x_old - x_avg) but exact in floating point for the documented reduction:
  sign -> identity, beta1 = beta2 = 0, gamma = 1, wd = 0 returns x_avg bit for bit, i.e. Local AdamW.
* ``sign="randomized"``: the stochastic sign of the theory, ±1 with P(+1) = (1 + c/R)/2 where R is
  the largest |c| over the whole model (one scalar all-reduce when sharded), so E[s] = c/R.
* The sign function can also be injected (``sign_fn=``) when the class is used as a library.

Use in your own loop::

    strategy = DSMLS(model, Comm.from_process_group(), OptimizerSpec(kind="dsm", lr=6e-4))
    for step in range(steps):
        strategy.zero_grad(); loss_fn(strategy.model(x), y).backward(); strategy.step(step, lr)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vigil.comm import Comm
from vigil.contract.optimizer_params import DSMParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import StateLayout
from vigil.optim.local import _OuterStateMixin

KEY_SIGN_RNG = "sign_rng"

SignFn = Callable[[torch.Tensor], torch.Tensor]


class DSMLS(_OuterStateMixin):
    """Local AdamW every step; a sign-momentum global step on the averaged model every ``tau`` steps."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec, *, sign_fn: SignFn | None = None) -> None:
        self.config = spec.typed_params(DSMParams)
        super().__init__(model, comm, spec, tau=self.config.tau, sharded=self.config.sharded)
        # Sharded: each owner draws for its own shard; replicated: every rank draws the same numbers.
        seed = self.config.seed + (comm.rank if self.config.sharded else 0)
        self.sign_rng = torch.Generator(device=self.flat.buffer.device).manual_seed(seed)
        if sign_fn is not None:
            self.sign_fn: SignFn = sign_fn
        elif self.config.sign == "randomized":
            self.sign_fn = self._randomized_sign
        else:
            self.sign_fn = torch.sign

    def _randomized_sign(self, c: torch.Tensor) -> torch.Tensor:
        radius = c.abs().max() if c.numel() else c.new_zeros(())
        radius = radius.reshape(1).clone()
        if self.sharded and self.comm.world_size > 1:
            self.comm.all_reduce(radius, op=dist.ReduceOp.MAX, tag="sync_scalar", elements=0)
        scale = 1.0 / radius.clamp_min(torch.finfo(c.dtype).tiny)
        p_plus = c.mul(scale).add_(1.0).mul_(0.5)
        u = torch.rand(c.shape, generator=self.sign_rng, dtype=c.dtype, device=c.device)
        return torch.where(u < p_plus, 1.0, -1.0).to(c.dtype)

    def outer(self, x_avg: torch.Tensor, lr: float) -> torch.Tensor:
        if lr <= 0:
            raise ValueError(f"dsm: the pseudo-gradient divides by lr, which is {lr} at this sync")
        assert self.x_old is not None and self.m is not None
        cfg = self.config
        x_avg = x_avg.to(torch.float32)
        d = self.x_old.sub(x_avg).div_(lr)
        c = self.m.mul(cfg.beta1).add_(d, alpha=1.0 - cfg.beta1)
        s = self.sign_fn(c)
        # x_old*(1 - gamma*lr*wd) - gamma*lr*s  ==  x_avg + lr*(d - gamma*(s + wd*x_old))
        x_new = d.sub(s.add(self.x_old, alpha=cfg.global_wd), alpha=cfg.gamma).mul_(lr).add_(x_avg)
        self.m.mul_(cfg.beta2).add_(d, alpha=1.0 - cfg.beta2)
        self.x_old.copy_(x_new)
        return self.x_old

    def _outer_state(self) -> dict[str, Any]:
        return {**super()._outer_state(), KEY_SIGN_RNG: self.sign_rng.get_state()}

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        super()._load_outer_state(state)
        self.sign_rng.set_state(state[KEY_SIGN_RNG])

    def state_layout(self) -> StateLayout:
        """As SlowMo; the randomized-sign generator is each shard owner's own when sharded (a rank
        new to the job keeps its freshly seeded one), shared when replicated."""
        layout = super().state_layout()
        if not self.sharded:
            return layout
        return StateLayout(sharded=layout.sharded, local=(*layout.local, (KEY_SIGN_RNG,)), current=layout.current,
                           local_model=layout.local_model, padded=layout.padded)
