"""Local steps with periodic synchronisation: Local AdamW and SlowMo (ALGORITHMS.md, baselines).

Every rank takes a local AdamW step every step (its moments stay local, never averaged or reset);
every ``tau`` steps the ranks average their models and an *outer* update turns the average into the
new common model:

* :class:`LocalAdamW`: the average itself (periodic model averaging).
* :class:`SlowMo` (Wang et al., ICLR 2020; fairscale's ``SlowMoDistributedDataParallel``)::

      m     = beta*m + (x_old - x_avg)/lr
      x_old = x_old - alpha*lr*m
      every x_i <- x_old

* ``vigil.optim.dsm.DSMLS`` (the sign-momentum outer step) builds on the same base.

The average is either one fp32 all-reduce (``sharded=False``) or a reduce-scatter to shard owners
followed by an all-gather of the updated shards (``sharded=True``): each rank then keeps only its
1/N shard of the outer state (x_old, m), in fp32, and runs the outer update on that shard alone,
which is how fairscale's memory-efficient SlowMo and the DSM reference implementation do it. Both
move the same ring wire bytes; see :mod:`vigil.comm` for how their payload is counted.

Use in your own loop::

    strategy = SlowMo(model, Comm.from_process_group(), OptimizerSpec(kind="slowmo", lr=1e-3))
    for step in range(steps):
        strategy.zero_grad(); loss_fn(strategy.model(x), y).backward(); strategy.step(step, lr)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from vigil.comm import Comm
from vigil.contract.optimizer_params import LocalAdamWParams, OptimizerParams, SlowMoParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import Shard, StateLayout, StatePath, Strategy, clip_grad
from vigil.optim.flat import FlatParams, broadcast_module, module_with, trainable

log = logging.getLogger(__name__)

KEY_OPTIMIZER = "optimizer"
KEY_LOCAL_STEPS = "local_steps"
KEY_X_OLD = "x_old"
KEY_MOMENTUM = "m"
KEY_WORLD_SIZE = "world_size"
KEY_SHARDED = "sharded"


class PeriodicAveraging(Strategy):
    """Local AdamW every step; every ``tau`` local steps average the models and apply :meth:`outer`.

    Subclasses override :meth:`outer` (and :meth:`_outer_state` / :meth:`_load_outer_state` when
    they keep state). The step counter is internal (local steps taken), so the sync phase survives
    a restore independent of how the caller numbers steps.

    A sync happens once ``tau`` local steps have passed since the last one (``local_steps - last_sync >=
    tau``): every multiple of ``tau`` while ``tau`` does not change, and a sound schedule when
    :meth:`reconfigure` changes it mid-period (a longer ``tau`` waits for the rest of it, a shorter one
    that is already over syncs at the next step). ``last_sync`` is not checkpointed (the format stays as it
    was): a restore takes it as the last multiple of the current ``tau``, which is where it was unless
    ``tau`` changed since.
    """

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec, *, tau: int, sharded: bool) -> None:
        super().__init__(model, comm)
        self.spec = spec
        self.tau = tau
        self.sharded = sharded
        broadcast_module(model, comm)
        self.params = trainable(model)
        self.flat = FlatParams(self.params, pad_to=max(1, comm.world_size))
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
        self.local_steps = 0
        self.last_sync = 0
        """``local_steps`` at the last sync (0: none yet)."""
        n = max(1, comm.world_size)
        self.shard_len = self.flat.padded // n if sharded else self.flat.padded
        self.lo = comm.rank * self.shard_len if sharded else 0
        self._eval_cache: nn.Module | None = None

    # -- the outer step (subclasses) ---------------------------------------------------------------

    def begin(self) -> None:
        """Called at the start of the first :meth:`step` (e.g. to take x_old from the start weights)."""

    def outer(self, x_avg: torch.Tensor, lr: float) -> torch.Tensor:
        """The new common model (this rank's shard when sharded) from the average ``x_avg``."""
        return x_avg

    def _outer_state(self) -> dict[str, Any]:
        return {}

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        pass

    # -- Strategy ----------------------------------------------------------------------------------

    def step(self, step: int, lr: float) -> None:
        if self.local_steps == 0:
            self.begin()
        clip_grad(self.module, self.spec.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.local_steps += 1
        if self.local_steps - self.last_sync >= self.tau:
            self.last_sync = self.local_steps
            self.sync(lr)

    def reconfigure(self, params: Any) -> None:
        """A new ``tau`` from the next step on (the only field that may change while the strategy runs; class
        docstring for the schedule). ``params``: this kind's typed params; ``ValueError`` when another field differs."""
        current: OptimizerParams | None = getattr(self, "config", None)  # the subclass's typed params
        if current is None or type(params) is not type(current):
            raise ValueError(f"{type(self).__name__}.reconfigure: expected {type(current).__name__}, "
                             f"got {type(params).__name__}")
        others = [f.name for f in dataclasses.fields(params)
                  if f.name != "tau" and getattr(params, f.name) != getattr(current, f.name)]
        if others:
            raise ValueError(f"{type(self).__name__}.reconfigure: only tau can change while it runs, not {others}")
        self.config, self.tau = params, params.tau

    @torch.no_grad()
    def sync(self, lr: float) -> None:
        """Average the models and apply the outer update (every ``tau`` local steps)."""
        buf = self.flat.buffer
        n = max(1, self.comm.world_size)
        if self.sharded:
            shard = torch.empty(self.shard_len, dtype=buf.dtype, device=buf.device)
            self.comm.reduce_scatter_tensor(shard, buf, tag="sync", elements=buf.numel())
            shard.div_(n)
            new = self.outer(shard, lr).to(buf.dtype)
            self.comm.all_gather_into_tensor(buf, new.contiguous(), tag="sync")
        else:
            self.comm.all_reduce(buf, tag="sync")
            buf.div_(n)
            new = self.outer(buf, lr)
            if new is not buf:
                buf.copy_(new)
        buf[self.flat.numel :].zero_()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            KEY_OPTIMIZER: self.optimizer.state_dict(),
            KEY_LOCAL_STEPS: self.local_steps,
            KEY_WORLD_SIZE: self.comm.world_size,
            KEY_SHARDED: self.sharded,
            **self._outer_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get(KEY_SHARDED, self.sharded) != self.sharded:
            raise ValueError("checkpoint was taken with a different 'sharded' setting")
        self.optimizer.load_state_dict(state[KEY_OPTIMIZER])
        self.local_steps = int(state[KEY_LOCAL_STEPS])
        self.last_sync = self.local_steps - self.local_steps % self.tau
        self._load_outer_state(state)

    # -- checkpoint layout (vigil.optim.base) ---------------------------------------------------

    def state_layout(self) -> StateLayout:
        """Local models and local AdamW moments; the step counter is replicated; the world size is current."""
        return StateLayout(local=((KEY_OPTIMIZER,),), current=((KEY_WORLD_SIZE,),), local_model=True)

    def eval_module(self) -> nn.Module:
        """The average of the current local models (an all-reduce tagged ``eval``)."""
        avg = self.flat.buffer.clone()
        self.comm.all_reduce(avg, tag="eval")
        avg.div_(max(1, self.comm.world_size))
        self._eval_cache = module_with(self.module, avg, self._eval_cache)
        return self._eval_cache


class _OuterStateMixin(PeriodicAveraging):
    """Keeps x_old and m (fp32; this rank's shard when sharded), x_old taken at the first step."""

    x_old: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def begin(self) -> None:
        if self.x_old is None:
            own = self.flat.buffer[self.lo : self.lo + self.shard_len]
            self.x_old = own.detach().to(torch.float32, copy=True)
            self.m = torch.zeros_like(self.x_old)

    def _outer_state(self) -> dict[str, Any]:
        return {KEY_X_OLD: self.x_old, KEY_MOMENTUM: self.m}

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        x_old, m = state[KEY_X_OLD], state[KEY_MOMENTUM]
        if x_old is None:
            self.x_old = self.m = None
            return
        if tuple(x_old.shape) != (self.shard_len,) or state.get(KEY_WORLD_SIZE) != self.comm.world_size:
            raise ValueError(
                f"outer state of shape {tuple(x_old.shape)} from {state.get(KEY_WORLD_SIZE)} ranks does not fit "
                f"shard length {self.shard_len} on {self.comm.world_size} ranks"
            )
        device = self.flat.buffer.device
        self.x_old = x_old.to(device=device, dtype=torch.float32, copy=True)
        self.m = m.to(device=device, dtype=torch.float32, copy=True)

    def state_layout(self) -> StateLayout:
        """As Local AdamW, plus x_old and m: sharded (this rank's slice) or replicated."""
        layout = super().state_layout()
        if not self.sharded:  # replicated, padded to a multiple of the world size
            padded: dict[StatePath, int] = {(KEY_X_OLD,): self.flat.padded, (KEY_MOMENTUM,): self.flat.padded}
            return StateLayout(local=layout.local, current=layout.current, local_model=True, padded=padded)
        shard = Shard(self.flat.numel, self.shard_len)
        return StateLayout(sharded={(KEY_X_OLD,): shard, (KEY_MOMENTUM,): shard}, local=layout.local,
                           current=layout.current, local_model=True)

    def after_restore(self, *, old_world_size: int, fresh: bool) -> None:
        """A rank new to the job starts from the last synchronised model x_old (gathered from the
        shard owners: every rank takes part)."""
        if self.x_old is None:
            return
        full = self.x_old.to(self.flat.buffer.dtype)
        if self.sharded and self.comm.world_size > 1:
            full = torch.empty_like(self.flat.buffer)
            self.comm.all_gather_into_tensor(full, self.x_old.to(full.dtype).contiguous(), tag="restore")
        if fresh:
            with torch.no_grad():
                self.flat.data.copy_(full[: self.flat.numel])

    def eval_module(self) -> nn.Module:
        """The last synchronised model x_old (gathered from its shard owners when sharded)."""
        if self.x_old is None:
            return self.module
        x = self.x_old.to(self.flat.buffer.dtype)
        if self.sharded:
            full = torch.empty_like(self.flat.buffer)
            self.comm.all_gather_into_tensor(full, x.contiguous(), tag="eval")
        else:
            full = x
        self._eval_cache = module_with(self.module, full, self._eval_cache)
        return self._eval_cache


# --------------------------------------------------------------------------------------------------
# Local AdamW
# --------------------------------------------------------------------------------------------------


class LocalAdamW(PeriodicAveraging):
    """Local AdamW with the models averaged every ``tau`` steps (32/tau b/p/step with one all-reduce)."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = spec.typed_params(LocalAdamWParams)
        super().__init__(model, comm, spec, tau=self.config.tau, sharded=self.config.sharded)


# --------------------------------------------------------------------------------------------------
# SlowMo
# --------------------------------------------------------------------------------------------------


class SlowMo(_OuterStateMixin):
    """Local AdamW + slow momentum on the averaged model every ``tau`` steps."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = spec.typed_params(SlowMoParams)
        super().__init__(model, comm, spec, tau=self.config.tau, sharded=self.config.sharded)

    def outer(self, x_avg: torch.Tensor, lr: float) -> torch.Tensor:
        if lr <= 0:
            raise ValueError(f"slowmo: the pseudo-gradient divides by lr, which is {lr} at this sync")
        assert self.x_old is not None and self.m is not None
        cfg = self.config
        x_avg = x_avg.to(torch.float32)
        d = self.x_old.sub(x_avg).div_(lr)  # (x_old - x_avg) / lr
        self.m.mul_(cfg.beta).add_(d)
        # x_old - alpha*lr*m, evaluated as x_avg + lr*(d - alpha*m) (equal, since lr*d = x_old - x_avg),
        # so that alpha=1, beta=0 returns x_avg exactly: SlowMo reduces to Local AdamW bit for bit.
        x_new = d.sub_(self.m, alpha=cfg.alpha).mul_(lr).add_(x_avg)
        self.x_old.copy_(x_new)
        return self.x_old
