"""CSER and its baselines, with the global random block sparsifier (ALGORITHMS.md §3).

CSER (Xie, Zheng, Koyejo, Gupta, Li, Lin, NeurIPS 2020): communication-efficient SGD with error
reset. Per rank i: model x_i, local error e_i = 0, a momentum buffer (Nesterov momentum SGD, as in
the paper; weight decay is added to the gradient, as ``torch.optim.SGD`` does)::

    d_i = lr * (momentum-SGD direction incl. weight decay)
    c   = allreduce_mean(C1(d_i));  r_i = d_i - C1(d_i)        # partial sync of the update
    x_i -= c + r_i;   e_i -= r_i
    if t % H == 0:                                            # error reset
        ce = allreduce_mean(C2(e_i));  re_i = e_i - C2(e_i)
        x_i = x_i - e_i + ce + re_i;   e_i = re_i

Implementation note: x_i - e_i is the same on every rank (the invariant of the method). It is kept
as its own tensor ``x_hat`` and updated only with the all-reduced values (x_hat -= c at every
step, x_hat += ce at a reset), so it stays bitwise identical on all ranks; the parameters are then
x_i = x_hat + e_i. This is the rule above rearranged (one extra model copy), and it avoids the
rank-dependent rounding of updating x_i and e_i separately.

Compressor GRBS (global random block sparsifier): per tensor one contiguous block of
``numel // R`` elements (at least 1), at a position drawn from a generator seeded identically on
every rank, so all ranks select the same block and only the block's fp32 values are all-reduced (no
indices). R = 1 is the identity, R = 0 the zero compressor (nothing sent; the paper's R = inf).
Wire: 32 (1/R_C1 + 1/(H R_C2)) b/p/step; with H = R_C1/R_C2 the overall ratio is R_C1/2.

* :class:`CSER` (``cser``; ``cser_pl`` sets C1 = 0: only the periodic reset communicates).
* :class:`EFSGD` (``ef_sgd``): error feedback with the same compressor, every step.
* :class:`QSparseLocalSGD` (``qsparse_local_sgd``, Basu et al. 2019): H local steps, then the
  compressed sum of the local progress and the error memory updates the global model.

Use in your own loop::

    strategy = CSER(model, Comm.from_process_group(), OptimizerSpec(kind="cser", lr=0.1, params={"rc1": 32}))
    for step in range(steps):
        strategy.zero_grad(); loss_fn(strategy.model(x), y).backward(); strategy.step(step, lr)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vigil.comm import Comm
from vigil.contract.optimizer_params import CSERParams, EFSGDParams, QSparseParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import StateLayout, Strategy, clip_grad
from vigil.optim.flat import FlatParams, broadcast_module, module_with, trainable

KEY_STEPS = "steps"
KEY_MOMENTUM = "momentum_buffer"
KEY_ERROR = "error"
KEY_X_HAT = "x_hat"
KEY_C1 = "c1_rng"
KEY_C2 = "c2_rng"
KEY_C = "c_rng"


class GRBS:
    """Global random block sparsifier over a flat vector made of tensors of ``sizes`` elements.

    :meth:`indices` returns the flat indices of one contiguous block per tensor (``None`` for the
    identity). Every rank that constructs it with the same ``seed`` and calls it in the same order
    gets the same blocks.
    """

    def __init__(self, sizes: list[int], ratio: float, seed: int, device: torch.device | str = "cpu") -> None:
        if ratio != 0 and ratio < 1:
            raise ValueError(f"GRBS ratio must be 0 (send nothing) or >= 1, got {ratio}")
        self.ratio = ratio
        self.numel = sum(sizes)
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self._sizes = torch.tensor(sizes, dtype=torch.int64)
        self._offsets = torch.cumsum(self._sizes, 0) - self._sizes
        if ratio >= 1:
            self._blocks = torch.clamp(torch.floor(self._sizes.double() / ratio).long(), min=1)
        else:
            self._blocks = torch.zeros_like(self._sizes)
        self.selected = int(self._blocks.sum())
        starts_of_blocks = torch.cumsum(self._blocks, 0) - self._blocks
        self._within = torch.arange(self.selected) - torch.repeat_interleave(starts_of_blocks, self._blocks)

    @property
    def is_identity(self) -> bool:
        return self.ratio == 1

    @property
    def is_zero(self) -> bool:
        return self.ratio == 0

    def indices(self) -> torch.Tensor | None:
        """This call's block indices into the flat vector (the identity: ``None``, the zero: empty)."""
        if self.is_identity:
            return None
        u = torch.rand(len(self._sizes), generator=self.generator, dtype=torch.float64)
        starts = torch.floor(u * (self._sizes - self._blocks + 1).double()).long()
        base = self._offsets + starts
        return (torch.repeat_interleave(base, self._blocks) + self._within).to(self.device)

    def state_dict(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


class _MomentumSGD(Strategy):
    """Flat parameters, Nesterov momentum SGD direction, init broadcast; base of this module."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec, momentum: float, nesterov: bool) -> None:
        super().__init__(model, comm)
        self.spec = spec
        self.momentum = momentum
        self.nesterov = nesterov
        broadcast_module(model, comm)
        self.params = trainable(model)
        self.flat = FlatParams(self.params)
        self.buf = torch.zeros_like(self.flat.data)
        self.steps = 0
        self._grad = torch.zeros_like(self.flat.buffer)
        self._eval_cache: nn.Module | None = None

    def direction(self, lr: float) -> torch.Tensor:
        """d = lr * (g + mu*buf) with buf = mu*buf + g and g = grad + wd*x (Nesterov; ``torch.optim.SGD``)."""
        clip_grad(self.module, self.spec.grad_clip)
        g = self.flat.grads(self._grad)[: self.flat.numel]
        if self.spec.weight_decay:
            g.add_(self.flat.data, alpha=self.spec.weight_decay)
        self.buf.mul_(self.momentum).add_(g)
        d = g.add(self.buf, alpha=self.momentum) if self.nesterov else self.buf.clone()
        return d.mul_(lr)

    def mean_of(self, vec: torch.Tensor, idx: torch.Tensor | None, tag: str) -> torch.Tensor:
        """All-reduce mean of ``vec[idx]`` (all of ``vec`` when ``idx`` is None); a new tensor."""
        vals = vec.clone() if idx is None else vec[idx]
        self.comm.all_reduce(vals, tag=tag, elements=vec.numel())
        return vals.div_(max(1, self.comm.world_size))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _base_state(self) -> dict[str, Any]:
        return {KEY_STEPS: self.steps, KEY_MOMENTUM: self.buf.clone()}

    def _load_base_state(self, state: dict[str, Any]) -> None:
        buf = state[KEY_MOMENTUM]
        if buf.shape != self.buf.shape:
            raise ValueError(f"momentum buffer of shape {tuple(buf.shape)}, model has {self.flat.numel} elements")
        self.buf.copy_(buf)
        self.steps = int(state[KEY_STEPS])

    def _eval_from(self, x: torch.Tensor) -> nn.Module:
        self._eval_cache = module_with(self.module, x, self._eval_cache)
        return self._eval_cache


# --------------------------------------------------------------------------------------------------
# CSER
# --------------------------------------------------------------------------------------------------


class CSER(_MomentumSGD):
    """Partial synchronisation of every update through C1, error reset through C2 every H steps."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        # cser_pl pins rc1 = 0 (vigil.contract.optimizer_params.KIND_FIXED): the parsed params say so.
        self.config = cfg = spec.typed_params(CSERParams)
        super().__init__(model, comm, spec, cfg.momentum, cfg.nesterov)
        device = self.flat.buffer.device
        self.c1 = GRBS(self.flat.sizes, cfg.rc1, cfg.seed, device)
        self.c2 = GRBS(self.flat.sizes, cfg.rc2, cfg.seed + 1, device)
        self.x_hat = self.flat.data.clone()  # x_i - e_i, identical on all ranks
        self.error = torch.zeros_like(self.x_hat)

    @torch.no_grad()
    def step(self, step: int, lr: float) -> None:
        if self.steps == 0:  # e = 0: x_hat starts at the weights the first step starts from
            self.x_hat.copy_(self.flat.data)
        d = self.direction(lr)
        if not self.c1.is_zero:
            idx = self.c1.indices()
            c = self.mean_of(d, idx, "grads")
            if idx is None:
                self.x_hat.sub_(c)
                d.zero_()  # r = d - C1(d) = 0
            else:
                self.x_hat.index_add_(0, idx, c, alpha=-1.0)
                d[idx] = 0.0
        self.error.sub_(d)  # e -= r
        self.steps += 1
        if self.steps % self.config.H == 0 and not self.c2.is_zero:
            idx = self.c2.indices()
            ce = self.mean_of(self.error, idx, "reset")
            if idx is None:
                self.x_hat.add_(ce)
                self.error.zero_()
            else:
                self.x_hat.index_add_(0, idx, ce)
                self.error[idx] = 0.0
        torch.add(self.x_hat, self.error, out=self.flat.data)  # x_i = (x_i - e_i) + e_i

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._base_state(), KEY_X_HAT: self.x_hat.clone(), KEY_ERROR: self.error.clone(),
            KEY_C1: self.c1.state_dict(), KEY_C2: self.c2.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.x_hat.copy_(state[KEY_X_HAT])
        self.error.copy_(state[KEY_ERROR])
        self.c1.load_state_dict(state[KEY_C1])
        self.c2.load_state_dict(state[KEY_C2])

    def state_layout(self) -> StateLayout:
        """Local momentum and error e_i, local model x_i = x_hat + e_i; x_hat and the shared-seed
        generators replicated."""
        return StateLayout(local=((KEY_MOMENTUM,), (KEY_ERROR,)), local_model=True)

    def after_restore(self, *, old_world_size: int, fresh: bool) -> None:
        """A rank new to the job has e_i = 0, so its model is x_hat."""
        if fresh:
            self.flat.data.copy_(self.x_hat)

    def eval_module(self) -> nn.Module:
        """The synchronised model x_i - e_i (the same on every rank; no communication)."""
        return self._eval_from(self.x_hat)


# --------------------------------------------------------------------------------------------------
# EF-SGD
# --------------------------------------------------------------------------------------------------


class EFSGD(_MomentumSGD):
    """Error feedback: p_i = d_i + e_i; x -= mean_i C(p_i); e_i = p_i - C(p_i). Models stay identical."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = cfg = spec.typed_params(EFSGDParams)
        super().__init__(model, comm, spec, cfg.momentum, cfg.nesterov)
        self.compressor = GRBS(self.flat.sizes, cfg.ratio, cfg.seed, self.flat.buffer.device)
        self.error = torch.zeros_like(self.flat.data)

    @torch.no_grad()
    def step(self, step: int, lr: float) -> None:
        p = self.error.add_(self.direction(lr))  # p = d + e, kept in the error buffer
        idx = self.compressor.indices()
        c = self.mean_of(p, idx, "grads")
        if idx is None:
            self.flat.data.sub_(c)
            p.zero_()
        else:
            self.flat.data.index_add_(0, idx, c, alpha=-1.0)
            p[idx] = 0.0  # e = p - C(p)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), KEY_ERROR: self.error.clone(), KEY_C: self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.error.copy_(state[KEY_ERROR])
        self.compressor.load_state_dict(state[KEY_C])

    def state_layout(self) -> StateLayout:
        """Local momentum and error; the model (identical on every rank) and the generator replicated."""
        return StateLayout(local=((KEY_MOMENTUM,), (KEY_ERROR,)))


# --------------------------------------------------------------------------------------------------
# QSparse-local-SGD
# --------------------------------------------------------------------------------------------------


class QSparseLocalSGD(_MomentumSGD):
    """H local steps; then g_i = x_hat - x_i + e_i, x_hat -= mean_i C(g_i), e_i = g_i - C(g_i), x_i = x_hat."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = cfg = spec.typed_params(QSparseParams)
        super().__init__(model, comm, spec, cfg.momentum, cfg.nesterov)
        self.compressor = GRBS(self.flat.sizes, cfg.ratio, cfg.seed, self.flat.buffer.device)
        self.x_hat = self.flat.data.clone()  # the last synchronised model
        self.error = torch.zeros_like(self.x_hat)

    @torch.no_grad()
    def step(self, step: int, lr: float) -> None:
        x = self.flat.data
        if self.steps == 0:  # the global model starts at the weights the first step starts from
            self.x_hat.copy_(x)
        x.sub_(self.direction(lr))
        self.steps += 1
        if self.steps % self.config.H == 0:
            g = self.error.add_(self.x_hat).sub_(x)  # g = x_hat - x + e, kept in the error buffer
            idx = self.compressor.indices()
            c = self.mean_of(g, idx, "sync")
            if idx is None:
                self.x_hat.sub_(c)
                g.zero_()
            else:
                self.x_hat.index_add_(0, idx, c, alpha=-1.0)
                g[idx] = 0.0
            x.copy_(self.x_hat)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._base_state(), KEY_X_HAT: self.x_hat.clone(), KEY_ERROR: self.error.clone(),
            KEY_C: self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.x_hat.copy_(state[KEY_X_HAT])
        self.error.copy_(state[KEY_ERROR])
        self.compressor.load_state_dict(state[KEY_C])

    def state_layout(self) -> StateLayout:
        """Local momentum, error and model (between syncs); x_hat and the generator replicated."""
        return StateLayout(local=((KEY_MOMENTUM,), (KEY_ERROR,)), local_model=True)

    def after_restore(self, *, old_world_size: int, fresh: bool) -> None:
        """A rank new to the job starts from the last synchronised model x_hat (no local progress yet)."""
        if fresh:
            self.flat.data.copy_(self.x_hat)

    def eval_module(self) -> nn.Module:
        """The last synchronised model (the same on every rank; no communication)."""
        return self._eval_from(self.x_hat)
