"""Two-way compressed AdamW with error feedback on both sides (ALGORITHMS.md §4).

After Zhong, Xie, Zheng, Lin, "Compressed Communication for Distributed Training: Adaptive Methods
and System" (BytePS-Compress, arXiv 2105.07829). The parameter-server role is played by the shard
owners: the zero-padded flat gradient is cut into N equal partitions and rank j owns partition j::

    worker i: p_i = g_i + e_i;  c_i = C(p_i);  e_i = p_i - D(c_i)         # push: all-to-all of c_i[j] to owner j
    owner j:  s = mean_i D(c_i[j]) + e_s;  c_s = C(s);  e_s = s - D(c_s)  # pull: all-gather of every c_s
    worker:   g_hat = D(c_s for all partitions);  AdamW step on g_hat

Placement of the Adam moments (followed here): on every worker, updated from the decompressed
pulled gradient g_hat. Every rank decodes g_hat from the same bytes, so the moments and the
parameters are bitwise identical on all ranks (tested); the owners (the servers) aggregate and
error-compensate *gradients* only and keep no optimizer state. Why this one: it is the placement
of the ALGORITHMS.md pseudo-code and of the authors' own system. In BytePS-Compress (github
bytedance/byteps, ``byteps/torch/__init__.py``, ``byteps/common/compressor/``) the
``DistributedOptimizer`` compresses each parameter's gradient (vanilla error feedback: p = g + e,
e = p - C(p), on the worker and again on the server after summing), and the wrapped torch optimizer
(Adam / LANS) then steps on the decompressed result on every worker; the authors' BERT scripts
(github as9ceIiF7D/byteps-compress, ``BERT/scripts/run_pretraining.sh``) run exactly that with
``--compressor onebit --onebit-scaling --ef vanilla``. The text of the paper's Algorithm 1 could not
be retrieved where this was written (only its abstract), so whether the algorithm as *analysed*
compresses something else (e.g. a preconditioned update or the momentum) is not confirmed; the
alternative would keep (m, v) on the owner of each partition and compress the Adam update.

What error feedback does to Adam here (measured on the convergence benchmark's model, 4 ranks,
192 steps; docs/BENCHMARKS.md "Convergence"): with onebit, every coordinate of a scale group
receives +-s, s = mean |g + e| of the group. A few coordinates with large, steady gradients
(frequent bytes' embedding rows, biases) exceed s every step, keep the excess in e, and their
error grows until s itself is that large: mostly 5-70x the gradient per tensor, up to 135x (a
synthetic vector with 1/64 of its coordinates 10x the rest reaches 31x). Those coordinates then move on gradients tens
of steps old, and every other coordinate gets +-s alternating around its small true gradient,
which Adam normalises by sqrt(v) ~ s into steps that are mostly that oscillation. Measured: after
step 48 the step's cosine with the true mean gradient is 0.01-0.04 with error feedback and
0.09-0.10 without (median step 0.055 vs 0.13 x lr); the loss stalls near 3.3 (still 3.24 after
960 steps). Without error feedback each coordinate gets sign(g_i) s, which Adam turns into a
sign-momentum step on the current gradient. The harm comes from the worker-side buffer (worker
error only: 3.24; owner error only: 2.81; neither: 2.68; DDP AdamW 2.42, seed 0), and top-k with
error feedback shows it too (bursts: a coordinate sent once in K steps arrives K times larger).
This is the interaction of error compensation with Adam's non-linear normalisation that 1-bit Adam
(Tang et al., 2021) avoids by freezing v after an uncompressed warmup; it is not a defect of the
error buffers, whose bookkeeping is exact (``test_error_feedback_loses_nothing``).

Compressors (vectorized; every message is a uint8 tensor, one row per partition):

* ``onebit``: sign bits packed 8 per byte + one fp32 scale = mean|x| per group of ``chunk``
  elements (``chunk=0``: one scale per piece of a parameter tensor inside a partition, as BytePS
  compresses every tensor on its own: a scale never spans two tensors, whose gradients differ by
  10-100x in magnitude). 1 + 32/chunk b/p per direction (chunk=0: 1 + 32 S/P, S the most tensor
  pieces in one partition of P elements).
* ``randk``: k = ratio x partition values at positions drawn from a generator seeded identically on
  every rank (with replacement, as BytePS), values only: 32 k/d. Without error feedback the values
  are scaled by d/k (unbiased), as BytePS does when no error feedback is configured.
* ``topk``: the k largest |x| per partition, values + int32 indices: 64 k/d.

``error_feedback=False`` drops both error buffers (the ablation: a clear loss gap without them).

Use in your own loop::

    strategy = CompressedAdamW(model, Comm.from_process_group(),
                               OptimizerSpec(kind="compressed_adam", params={"compressor": "onebit"}))
    for step in range(steps):
        strategy.zero_grad(); loss_fn(strategy.model(x), y).backward(); strategy.step(step, lr)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vigil.comm import Comm
from vigil.contract.optimizer_params import CompressedAdamParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import Shard, StateLayout, Strategy, clip_grad
from vigil.optim.flat import FlatParams, broadcast_module, trainable

KEY_OPTIMIZER = "optimizer"
KEY_STEPS = "steps"
KEY_WORKER_ERROR = "worker_error"
KEY_OWNER_ERROR = "owner_error"
KEY_RNG = "compressor_rng"

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _bytes_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a slice of a uint8 message as ``dtype`` (copying only when it is not aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if not t.is_contiguous() or t.storage_offset() % size or any(st % size for st in t.stride()[:-1]):
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t.view(dtype)


class Compressor:
    """C and D for rows of equal partitions: ``compress(x[G, P]) -> uint8[G, B]``, ``decompress`` back.

    ``rows`` says which partitions the rows are (randk draws positions for all N partitions at
    once, so every rank knows every partition's positions).
    """

    def __init__(self, cfg: CompressedAdamParams, partition: int, parts: int, real: torch.Tensor, seed: int,
                 sizes: Sequence[int] | None = None) -> None:
        self.cfg = cfg
        self.partition = partition
        self.parts = parts
        self.group = cfg.chunk if cfg.chunk else partition
        self.k = max(1, min(partition, round(cfg.ratio * partition)))
        real_rows = real.view(parts, partition)
        # onebit with chunk=0: one scale per piece of a tensor inside a partition (``sizes``: the
        # flat buffer's tensors in order), as BytePS compresses every tensor on its own; a scale
        # spanning several tensors would be the mean |x| of gradients whose magnitudes differ by
        # 10-100x between layers. ``segments``: [parts, P] scale index of every element (padding
        # joins the last tensor's piece); ``scales``: scales per message (the most pieces any
        # partition has; a partition with fewer sends zeros in the spare slots).
        self.segments: torch.Tensor | None = None
        if cfg.compressor == "onebit" and not cfg.chunk and sizes:
            ends = torch.tensor(list(sizes), dtype=torch.long).cumsum(0)
            tensor = torch.searchsorted(ends, torch.arange(parts * partition), right=True)
            tensor = tensor.clamp_max(len(ends) - 1).view(parts, partition)
            self.segments = (tensor - tensor[:, :1]).to(real.device)
            self.scales = int(self.segments.max()) + 1
            # Real (not padding) elements per scale, per partition: [parts, scales]
            self.counts = torch.zeros(parts, self.scales, device=real.device).scatter_add_(
                1, self.segments, real_rows.float()).clamp_min(1)
        else:
            self.scales = partition // self.group
            # Real (not padding) elements per onebit scale group, per partition: [parts, P // group]
            # (on the parameters' device; the positions of randk are drawn on the CPU, identically everywhere).
            self.counts = real_rows.view(parts, self.scales, self.group).sum(-1).clamp_min(1).float()
        self.generator = torch.Generator().manual_seed(seed)
        self._idx: torch.Tensor | None = None

    def draw(self) -> None:
        """randk: the positions of this round's message for every partition (shared by all ranks)."""
        if self.cfg.compressor == "randk":
            self._idx = torch.randint(0, self.partition, (self.parts, self.k), generator=self.generator)

    def message_bytes(self) -> int:
        if self.cfg.compressor == "onebit":
            return self.partition // 8 + 4 * self.scales
        return 4 * self.k if self.cfg.compressor == "randk" else 8 * self.k

    def compress(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        g = x.shape[0]
        if self.cfg.compressor == "onebit":
            r = rows.to(self.counts.device)
            if self.segments is None:
                scale = x.view(g, -1, self.group).abs().sum(-1).div_(self.counts[r])
            else:
                scale = torch.zeros(g, self.scales, dtype=x.dtype, device=x.device).scatter_add_(
                    1, self.segments[r], x.abs()).div_(self.counts[r])
            bits = (x < 0).view(g, -1, 8).to(torch.uint8) << _SHIFTS.to(x.device)
            packed = bits.sum(-1, dtype=torch.uint8)
            return torch.cat([packed, scale.contiguous().view(torch.uint8).view(g, -1)], dim=1)
        if self.cfg.compressor == "randk":
            assert self._idx is not None
            vals = x.gather(1, self._idx[rows].to(x.device))
            if not self.cfg.error_feedback:
                vals = vals * (self.partition / self.k)
            return vals.contiguous().view(torch.uint8).view(g, -1)
        idx = x.abs().topk(self.k, dim=1, sorted=False).indices
        vals = x.gather(1, idx)
        return torch.cat(
            [vals.contiguous().view(torch.uint8).view(g, -1), idx.to(torch.int32).view(torch.uint8).view(g, -1)], dim=1
        )

    def decompress(self, msg: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        g = msg.shape[0]
        if self.cfg.compressor == "onebit":
            nb = self.partition // 8
            bits = (msg[:, :nb].unsqueeze(-1) >> _SHIFTS.to(msg.device)) & 1
            scale = _bytes_as(msg[:, nb:], torch.float32)
            if self.segments is not None:
                sign = 1.0 - 2.0 * bits.view(g, self.partition).float()
                return sign * scale.gather(1, self.segments[rows.to(self.segments.device)])
            sign = 1.0 - 2.0 * bits.view(g, -1, self.group).float()
            return (sign * scale.unsqueeze(-1)).view(g, self.partition)
        out = torch.zeros(g, self.partition, dtype=torch.float32, device=msg.device)
        if self.cfg.compressor == "randk":
            assert self._idx is not None
            return out.scatter_(1, self._idx[rows].to(msg.device), _bytes_as(msg, torch.float32))
        vals = _bytes_as(msg[:, : 4 * self.k], torch.float32)
        idx = _bytes_as(msg[:, 4 * self.k :], torch.int32).long()
        return out.scatter_(1, idx, vals)


class CompressedAdamW(Strategy):
    """Push (all-to-all) and pull (all-gather) of compressed gradients with two-way error feedback, then AdamW."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        super().__init__(model, comm)
        self.spec = spec
        self.config = cfg = spec.typed_params(CompressedAdamParams)
        broadcast_module(model, comm)
        self.params = trainable(model)
        n = max(1, comm.world_size)
        align = math.lcm(8, cfg.chunk) if cfg.compressor == "onebit" and cfg.chunk else 8
        self.flat = FlatParams(self.params, pad_to=n * align)
        self.parts, self.partition = n, self.flat.padded // n
        device = self.flat.buffer.device
        real = torch.zeros(self.flat.padded, dtype=torch.bool, device=device)
        real[: self.flat.numel] = True
        self._real_owner = real.view(n, self.partition)[comm.rank if n > 1 else 0]
        self.compressor = Compressor(cfg, self.partition, n, real, cfg.seed, self.flat.sizes)
        self.worker_error = torch.zeros(self.flat.padded, dtype=torch.float32, device=device)
        self.owner_error = torch.zeros(self.partition, dtype=torch.float32, device=device)
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
        self.steps = 0
        self._rows = torch.arange(n)
        self._own = torch.tensor([comm.rank if n > 1 else 0])
        self._grad = torch.zeros(self.flat.padded, dtype=torch.float32, device=device)

    @torch.no_grad()
    def exchange(self, grad: torch.Tensor) -> torch.Tensor:
        """g_hat from this rank's flat (padded) gradient: push, owner aggregation, pull."""
        comm, cmp, n, part = self.comm, self.compressor, self.parts, self.partition
        ef = self.config.error_feedback
        # push: every rank compresses all partitions of p = g + e and sends partition j to its owner j
        cmp.draw()
        p = grad.add(self.worker_error) if ef else grad
        push = cmp.compress(p.view(n, part), self._rows)
        received = torch.empty_like(push)
        comm.all_to_all_single(received, push, tag="push", elements=p.numel())
        if ef:
            self.worker_error.copy_(p).sub_(cmp.decompress(push, self._rows).view(-1))
            self.worker_error[self.flat.numel :] = 0.0
        # owner: mean of what the workers sent for this partition, plus the owner's error
        s = cmp.decompress(received, self._own.expand(n)).sum(0).div_(n)
        if ef:
            s.add_(self.owner_error)
        s.masked_fill_(~self._real_owner, 0.0)
        cmp.draw()
        pull = cmp.compress(s.view(1, part), self._own)
        if ef:
            self.owner_error.copy_(s).sub_(cmp.decompress(pull, self._own).view(-1))
            self.owner_error.masked_fill_(~self._real_owner, 0.0)
        # pull: every owner's compressed result to everyone, decoded identically on every rank
        gathered = torch.empty(n * pull.numel(), dtype=torch.uint8, device=pull.device)
        comm.all_gather_into_tensor(gathered, pull.view(-1), tag="pull", elements=part)
        return cmp.decompress(gathered.view(n, -1), self._rows).view(-1)

    def step(self, step: int, lr: float) -> None:
        grad = self.flat.grads(self._grad)
        g_hat = self.exchange(grad)
        self.flat.set_grads(g_hat[: self.flat.numel])
        clip_grad(self.module, self.spec.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.steps += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            KEY_OPTIMIZER: self.optimizer.state_dict(),
            KEY_STEPS: self.steps,
            KEY_WORKER_ERROR: self.worker_error.clone(),
            KEY_OWNER_ERROR: self.owner_error.clone(),
            KEY_RNG: self.compressor.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        we, oe = state[KEY_WORKER_ERROR], state[KEY_OWNER_ERROR]
        if we.shape != self.worker_error.shape or oe.shape != self.owner_error.shape:
            raise ValueError(
                f"error buffers of shapes {tuple(we.shape)}, {tuple(oe.shape)} do not fit "
                f"{tuple(self.worker_error.shape)}, {tuple(self.owner_error.shape)} (another world size?)"
            )
        self.optimizer.load_state_dict(state[KEY_OPTIMIZER])
        self.steps = int(state[KEY_STEPS])
        self.worker_error.copy_(we)
        self.owner_error.copy_(oe)
        self.compressor.generator.set_state(state[KEY_RNG])

    def state_layout(self) -> StateLayout:
        """The worker error is each rank's own (a flat buffer padded for the world size); the owner
        error is sharded by partition; AdamW moments and the generator are replicated (every rank
        decodes the same pulled gradient)."""
        return StateLayout(sharded={(KEY_OWNER_ERROR,): Shard(self.flat.numel, self.partition)},
                           local=((KEY_WORKER_ERROR,),), padded={(KEY_WORKER_ERROR,): self.flat.padded})
