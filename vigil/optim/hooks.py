"""PyTorch's own DDP communication hooks, used as they are: PowerSGD and half-precision compression.

ALGORITHMS.md, baselines: these are the peers a user would pick instead of our optimizers, so the
model is wrapped in ``DistributedDataParallel`` and the hooks from
``torch.distributed.algorithms.ddp_comm_hooks`` run unmodified:

* :class:`PowerSGD`: ``powerSGD_hook`` with a ``PowerSGDState`` built from ``optimizer.params``
  (low-rank P, Q all-reduces per bucket after ``start_iter`` vanilla all-reduce steps, error
  feedback and warm start as in PyTorch's defaults).
* :class:`HalfCompress`: the half-precision hook picked by backend: ``fp16_compress_hook`` on gloo
  (CPU), ``bf16_compress_hook`` on NCCL (torch 2.13 refuses bf16 anywhere but CUDA+NCCL or XPU).

Then AdamW on the averaged gradients, exactly as the DDP AdamW baseline.

How the bytes are counted. The hooks call ``torch.distributed.all_reduce`` themselves, from inside
PyTorch, partly from future callbacks, so :class:`~vigil.comm.Comm` cannot issue them. Two ways
to observe them were possible: give the hook a process-group-like shim, or intercept the ``dist``
calls the hook makes. A shim would have to pass c10d's own checks on the ``group=`` argument
(registries, backend lookup: private and version-dependent), so this module intercepts instead:
each call runs a copy of the hook *function* (the same code object, untouched) whose module
globals see a counting stand-in for ``torch.distributed``. The stand-in forwards every call and adds
up the bytes of each ``all_reduce`` the hook issues (for PowerSGD: the uncompressed tensors, then P,
then Q; for the half hook: the fp16/bf16 buffer); any other collective raises, so no byte can go
uncounted. Nothing global is patched: DDP's own traffic and other threads see the real module.
One record per bucket: time from the hook call to the completion of its future, payload = what the
hook actually sent, ``elements`` = the bucket's gradient elements, tag ``grads``.

DDP is built with ``init_sync=False`` (the initial broadcast goes through ``Comm``, tag ``init``)
and without per-forward buffer broadcasts (buffers are broadcast once at start). What remains
outside the count is DDP's bookkeeping: the bucket-rebuild index broadcast after the first step.

Use in your own loop::

    strategy = PowerSGD(model, Comm.from_process_group(), OptimizerSpec(kind="powersgd", params={"rank": 2}))
    for step in range(steps):
        strategy.zero_grad(); loss_fn(strategy.model(x), y).backward(); strategy.step(step, lr)
"""

from __future__ import annotations

import logging
import math
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from vigil.comm import Comm
from vigil.contract.optimizer_params import HalfCompressParams, PowerSGDParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import StateLayout, Strategy, clip_grad
from vigil.optim.flat import broadcast_module, trainable

log = logging.getLogger(__name__)

KEY_OPTIMIZER = "optimizer"
KEY_POWERSGD = "powersgd"
KEY_LAYOUT = "bucket_layout"

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

_OTHER_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter",
    "all_reduce_coalesced", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


class _CountingDist:
    """Stands in for ``torch.distributed`` inside one call of a hook; adds up all-reduce payloads."""

    def __init__(self) -> None:
        self.payload_bytes = 0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.payload_bytes += tensor.numel() * tensor.element_size()
        self.calls += 1
        return dist.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _OTHER_COLLECTIVES:
            raise NotImplementedError(f"the hook issued dist.{name}; only all_reduce is counted")
        return getattr(dist, name)


def _copy_function(fn: types.FunctionType, globals_: dict[str, Any]) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


class _ModuleView:
    """A hook module as seen from another hook module, with the same ``dist`` stand-in."""

    def __init__(self, module: types.ModuleType, proxy: _CountingDist) -> None:
        self._module = module
        self._proxy = proxy

    def __getattr__(self, name: str) -> Any:
        obj = getattr(self._module, name)
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._module.__dict__:
            return _rebind(obj, self._proxy)
        return obj


def _rebind(fn: types.FunctionType, proxy: _CountingDist) -> types.FunctionType:
    """``fn`` (same code) with ``dist`` -> ``proxy`` in its globals, and likewise for the hook-module
    functions and modules it reaches (``_compress_hook``, ``default._allreduce_fut``)."""
    g = dict(fn.__globals__)
    for name, obj in fn.__globals__.items():
        if obj is dist:
            g[name] = proxy
        elif isinstance(obj, types.ModuleType) and obj.__name__.startswith(default_hooks.__package__ or "-"):
            g[name] = _ModuleView(obj, proxy)
    for name, obj in fn.__globals__.items():
        if isinstance(obj, types.FunctionType) and obj.__globals__ is fn.__globals__:
            g[name] = _copy_function(obj, g)
    return _copy_function(fn, g)


def counted_hook(
    hook: Hook, comm: Comm, *, tag: str = "grads", on_bucket: Callable[[dist.GradBucket], None] | None = None
) -> Hook:
    """``hook`` with every bucket's all-reduces timed and counted into ``comm`` (one record per bucket)."""

    def hook_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if on_bucket is not None:
            on_bucket(bucket)
        elements = bucket.buffer().numel()
        proxy = _CountingDist()
        t0 = time.perf_counter()
        fut = _rebind(hook, proxy)(state, bucket)  # type: ignore[arg-type]

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = f.value()  # re-raises a failed collective
            n = comm.world_size
            comm.record_external(
                "all_reduce", tag=tag, payload_bytes=proxy.payload_bytes,
                wire_bytes=int(2 * (n - 1) / n * proxy.payload_bytes) if n > 1 else 0,
                elements=elements, duration_s=time.perf_counter() - t0,
            )
            return value

        return fut.then(done)

    # DDP inspects the hook's name (it refuses a function *named* bf16_compress_hook off NCCL);
    # the backend choice is made explicitly in HalfCompress.
    hook_fn.__name__ = hook_fn.__qualname__ = f"counted_{hook.__name__}"
    # DDP compares the annotations with the real objects (these are strings under `from __future__`).
    hook_fn.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook_fn


class _DDPHookStrategy(Strategy):
    """DDP with a (counted) communication hook, then AdamW on the averaged gradients."""

    def __init__(
        self, model: nn.Module, comm: Comm, spec: OptimizerSpec, hook: Hook, hook_state: Any, bucket_cap_mb: float
    ) -> None:
        super().__init__(model, comm)
        self.spec = spec
        broadcast_module(model, comm)
        self._index = {id(p): i for i, p in enumerate(trainable(model))}
        # bucket index -> parameter indices it held the last time its hook ran
        self.layouts: dict[int, tuple[int, ...]] = {}
        self.hook_state = hook_state
        self.ddp: DistributedDataParallel | None = None
        if dist.is_available() and dist.is_initialized():
            self.ddp = DistributedDataParallel(
                model, init_sync=False, forward_sync_buffers=False, bucket_cap_mb=bucket_cap_mb
            )
            self.ddp.register_comm_hook(hook_state, counted_hook(hook, comm, on_bucket=self._on_bucket))
        self.optimizer = torch.optim.AdamW(
            trainable(model), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )

    def _on_bucket(self, bucket: dist.GradBucket) -> None:
        layout = tuple(self._index[id(p)] for p in bucket.parameters())
        previous = self.layouts.get(bucket.index())
        if previous is not None and previous != layout:
            self._layout_changed(bucket.index(), previous, layout)
        self.layouts[bucket.index()] = layout

    def _layout_changed(self, index: int, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        """Bucket ``index`` now lays out other parameters, or the same in another order (DDP
        rebuilds its buckets after the first step of every process, also after a restore)."""

    @property
    def model(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.module

    def step(self, step: int, lr: float) -> None:
        clip_grad(self.module, self.spec.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {KEY_OPTIMIZER: self.optimizer.state_dict(), KEY_LAYOUT: {k: list(v) for k, v in self.layouts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state[KEY_OPTIMIZER])
        self.layouts = {int(k): tuple(int(i) for i in v) for k, v in state.get(KEY_LAYOUT, {}).items()}


# --------------------------------------------------------------------------------------------------
# PowerSGD
# --------------------------------------------------------------------------------------------------


class PowerSGD(_DDPHookStrategy):
    """DDP + ``powerSGD_hook`` + AdamW."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = cfg = spec.typed_params(PowerSGDParams)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.rank,
            start_powerSGD_iter=cfg.start_iter,
            min_compression_rate=cfg.min_compression_rate,
            use_error_feedback=cfg.error_feedback,
            warm_start=cfg.warm_start,
            random_seed=cfg.seed,
        )
        self._shapes = [tuple(p.shape) for p in trainable(model)]
        super().__init__(model, comm, spec, powerSGD_hook.powerSGD_hook, state, cfg.bucket_cap_mb)

    def _layout_changed(self, index: int, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        # The hook's memory for this bucket (error, warm-start P and Q) is laid out per parameter in
        # bucket order. The hook's arithmetic is per parameter (and its all-reduces elementwise), so
        # moving each parameter's slices to the new order continues exactly where it left off.
        s = self.hook_state
        memories = (s.error_dict, s.p_memory_dict, s.q_memory_dict)
        if not any(index in d for d in memories):
            return
        if sorted(old) != sorted(new):
            for d in memories:
                d.pop(index, None)
            log.warning("powersgd: bucket %d now holds other parameters; its error feedback and warm start restart", index)
            return
        old_err, old_p, old_q = self._segments(old)
        new_err, new_p, new_q = self._segments(new)
        for d, old_seg, new_seg in ((s.error_dict, old_err, new_err), (s.p_memory_dict, old_p, new_p),
                                    (s.q_memory_dict, old_q, new_q)):
            if index in d:
                src = d[index]
                dst = torch.empty_like(src)
                for i, (o, n) in new_seg.items():
                    so, sn = old_seg[i]
                    assert sn == n
                    dst[o : o + n].copy_(src[so : so + sn])
                d[index] = dst

    def _segments(
        self, layout: tuple[int, ...]
    ) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
        """(offset, length) per parameter of the error, P and Q memories of a bucket with ``layout``,
        following ``powerSGD_hook``'s own layout (compressed matrices grouped by shape, in order of
        first appearance; P is n x r and Q m x r per matrix; batch_tensors_with_same_shape off)."""
        cfg = self.config
        err: dict[int, tuple[int, int]] = {}
        groups: dict[tuple[int, int], list[int]] = {}
        offset = 0
        for i in layout:
            shape = self._shapes[i]
            numel = math.prod(shape)
            err[i] = (offset, numel)
            offset += numel
            n = shape[0]
            m = numel // n
            r = min(n, m, cfg.rank)
            if powerSGD_hook._should_compress(n, m, r, cfg.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append(i)
        p_seg: dict[int, tuple[int, int]] = {}
        q_seg: dict[int, tuple[int, int]] = {}
        p_off = q_off = 0
        for (n, m), members in groups.items():
            r = min(n, m, cfg.rank)
            for i in members:
                p_seg[i] = (p_off, n * r)
                q_seg[i] = (q_off, m * r)
                p_off += n * r
                q_off += m * r
        return err, p_seg, q_seg

    def state_dict(self) -> dict[str, Any]:
        s = self.hook_state
        _, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            **super().state_dict(),
            KEY_POWERSGD: {
                "iter": s.iter,
                "rng_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "rng_pos": int(pos),
                "rng_has_gauss": int(has_gauss),
                "rng_cached_gaussian": float(cached),
                "error": {int(k): v.detach().clone() for k, v in s.error_dict.items()},
                "p": {int(k): v.detach().clone() for k, v in s.p_memory_dict.items()},
                "q": {int(k): v.detach().clone() for k, v in s.q_memory_dict.items()},
                "numel_before": int(s.total_numel_before_compression),
                "numel_after": int(s.total_numel_after_compression),
                "next_stats_report": int(s.next_stats_report),
            },
        }

    def state_layout(self) -> StateLayout:
        """The error-feedback memory is each rank's own; P and Q (all-reduced), the iteration
        counter, the shared-seed generator and AdamW's moments are replicated."""
        return StateLayout(local=((KEY_POWERSGD, "error"),))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state[KEY_POWERSGD]
        s = self.hook_state
        s.iter = int(saved["iter"])
        s.rng.set_state((
            "MT19937", saved["rng_keys"].numpy().astype(np.uint32), int(saved["rng_pos"]),
            int(saved["rng_has_gauss"]), float(saved["rng_cached_gaussian"]),
        ))
        s.error_dict = {int(k): v.clone() for k, v in saved["error"].items()}
        s.p_memory_dict = {int(k): v.clone() for k, v in saved["p"].items()}
        s.q_memory_dict = {int(k): v.clone() for k, v in saved["q"].items()}
        s.total_numel_before_compression = int(saved["numel_before"])
        s.total_numel_after_compression = int(saved["numel_after"])
        s.next_stats_report = int(saved["next_stats_report"])


# --------------------------------------------------------------------------------------------------
# Half-precision compression
# --------------------------------------------------------------------------------------------------


def half_hook_for_backend(backend: str | None) -> Hook:
    """``bf16_compress_hook`` on NCCL, ``fp16_compress_hook`` elsewhere (gloo/CPU)."""
    return default_hooks.bf16_compress_hook if backend == "nccl" else default_hooks.fp16_compress_hook


class HalfCompress(_DDPHookStrategy):
    """DDP + half-precision gradient all-reduce (16 b/p/step) + AdamW."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        self.config = spec.typed_params(HalfCompressParams)
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        self.hook = half_hook_for_backend(backend)
        super().__init__(model, comm, spec, self.hook, None, self.config.bucket_cap_mb)
