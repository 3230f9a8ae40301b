"""SDP4Bit (Jia, Xie et al., NeurIPS 2024): ZeRO-1 sharded data parallelism with ~4-bit communication.

Layout. All parameters live in one flat, zero-padded buffer, the *replica* (the model's parameters
are views into it). Its length is a multiple of ``world * 2048``-ish (the lcm of the weight group,
gradient group and Hadamard order, times the world size), split into ``world`` equal shards; rank
``r`` owns shard ``r``: the fp32 master weights of that shard and their AdamW state.

One step (``step``):

1. **Gradients -> this rank's shard of their mean.** ``fp32``: a reduce-scatter. ``tlq`` /
   ``tlq_hs`` / ``ulq`` (two-level quantization, ALGORITHMS.md §2): [Hadamard, order 32] ->
   Q8 (ULq: Q4), group 128 -> all-to-all inside the node -> dequantize + sum -> Q4, group 128 ->
   all-to-all across nodes -> dequantize + sum -> [inverse Hadamard] -> / world. Before the first
   all-to-all the buffer's shards are reordered so that the row sent to intra-node peer ``p`` holds
   the shards of ``p``'s inter-node group; after both hops every rank holds exactly its own shard.
   A hop whose group has one rank (one node, or one rank per node) moves nothing and so quantizes
   nothing.
2. **Clip** on the global gradient norm, computed from the shards (one scalar all-reduce).
3. **AdamW** on the master shard.
4. **Weights -> every replica.** ``fp32``: all-gather of the master shards. ``qwd``:
   ``D_r = cast(master_r) - replica[shard r]`` against the replica's current value, Q4 group 2048
   (stochastic), all-gather of values + scales, every rank adds ``deQ(D_j)`` to ``replica[shard j]``
   (the owner too), so quantization error does not accumulate and all replicas stay bitwise equal.
   ``qw``: the master shard itself is quantized and ``replica[shard j] = deQ(W_j)``.

Variants (``spec.kind``), each ablation changing only the component it names:

==================  ========  ========
kind                weights   grads
==================  ========  ========
sdp4bit             qwd       tlq_hs
sdp4bit_qw          qw        fp32
sdp4bit_qwd         qwd       fp32
sdp4bit_tlq         fp32      tlq
sdp4bit_tlq_hs      fp32      tlq_hs
sdp4bit_ulq         fp32      ulq
==================  ========  ========

``spec.params`` (``vigil.contract.optimizer_params.SDP4BitParams``, validated with the job spec, unknown
keys refused): ``weight_group`` (2048), ``grad_group``
(128), ``hadamard_order`` (32), ``ranks_per_node`` (override the discovered topology, for tests and
benchmarks on one machine), ``seed`` (0; the stochastic-rounding streams), ``weights`` /
``grads`` (override the kind's choice, e.g. ``weights="fp32", grads="fp32"`` is the uncompressed
ZeRO-1 baseline), ``compile`` (False; ``torch.compile`` the quantization kernels).

Wire (measured by :class:`Comm`, tags ``grads_intra``, ``grads_inter``, ``weights``, ``grads``):
each quantized message is one byte buffer (values, then the fp32 scales' bytes) per peer, and
``elements`` is the number of buffer elements it encodes, so bits/element = 8.25 intra, 4.25
inter, 4 + 32/2048 = 4.016 weights (32 for fp32). The padding is counted as elements: it is at most
``world * 2048`` elements, nothing at model scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vigil import quant
from vigil.comm import Comm
from vigil.contract.optimizer_params import GRAD_MODES, SDP4BIT_VARIANTS, WEIGHT_MODES, SDP4BitParams
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import Shard, StateLayout, Strategy
from vigil.topology import Topology, discover, layout

VARIANTS = SDP4BIT_VARIANTS
"""kind -> (weights, grads) of SDP4Bit and its ablations (``vigil.contract.optimizer_params``)."""
WEIGHT_BITS = 4
GRAD_BITS_INTER = 4

# Stream ids of the stochastic-rounding noise (combined with seed, rank and step counter).
_STREAM_WEIGHTS = 1
_STREAM_GRADS_INTRA = 2
_STREAM_GRADS_INTER = 3

# state_dict keys (CONVENTIONS 6).
KEY_MASTER = "master_shard"
KEY_REPLICA = "replica"
KEY_OPTIMIZER = "adamw"
KEY_RNG_COUNTER = "rng_counter"
KEY_SEED = "seed"
KEY_LAYOUT = "layout"


class SDP4Bit(Strategy):
    """ZeRO-1 AdamW with quantized weight (qW / qWD) and gradient (TLq / TLq-HS / ULq) communication."""

    def __init__(self, model: nn.Module, comm: Comm, spec: OptimizerSpec) -> None:
        super().__init__(model, comm)
        self.spec = spec
        self.cfg = spec.typed_params(SDP4BitParams)
        if self.cfg.compile:
            quant.set_compiled(True)
        self.topo: Topology = discover(self.cfg.ranks_per_node) if comm.world_size > 1 else layout(["local"], 0)
        if (self.topo.rank, self.topo.world_size) != (comm.rank, comm.world_size):
            raise ValueError(f"comm is rank {comm.rank}/{comm.world_size}, process group {self.topo.rank}/"
                             f"{self.topo.world_size}")
        self.rank, self.world = comm.rank, comm.world_size

        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("SDP4Bit: the model has no trainable parameters")
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"SDP4Bit needs one floating-point parameter dtype, got {dtypes}")
        dtype, device = self._params[0].dtype, self._params[0].device

        # Shards must hold whole weight groups, gradient groups and Hadamard blocks.
        unit = math.lcm(self.cfg.weight_group, self.cfg.grad_group, self.cfg.hadamard_order)
        self.numel = sum(p.numel() for p in self._params)
        self.shard_size = -(-self.numel // (self.world * unit)) * unit
        self.padded = self.shard_size * self.world

        # The replica: one flat buffer; parameters become views into it.
        self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                offset += n
        self._grad_flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        # Start from identical weights everywhere (rank 0's).
        self.comm.broadcast(self.flat, src=0, tag="init")

        lo = self.rank * self.shard_size
        self._shard = slice(lo, lo + self.shard_size)
        self.master = nn.Parameter(self.flat[self._shard].detach().to(torch.float32).clone())
        self.optimizer = torch.optim.AdamW([self.master], lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
        self._rng_counter = 0

        # Send order of the first gradient hop: to intra-node peer p (group-rank order), the shards
        # owned by p's inter-node group, in that group's rank order.
        perm = [s for p in self.topo.intra_ranks for s in self.topo.inter_ranks_of(p)]
        self._perm = torch.tensor(perm, dtype=torch.long, device=device)
        self._identity_perm = perm == list(range(self.world))

    # ------------------------------------------------------------------ the step

    def step(self, step: int, lr: float) -> None:
        grad = self._gather_grads()
        grad_shard = self._reduce_grads(grad)
        self._clip(grad_shard)
        self.master.grad = grad_shard
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.master.grad = None
        self._sync_weights()
        self._rng_counter += 1

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def _key(self, stream: int) -> tuple[int, int]:
        return quant.stream_key(self.cfg.seed, stream, self.rank, self._rng_counter)

    def _gather_grads(self) -> torch.Tensor:
        g = self._grad_flat
        offset = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                g[offset : offset + n].zero_()
            else:
                g[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return g  # the padding stays zero

    # ------------------------------------------------------------------ gradients

    def _reduce_grads(self, g: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean gradient over all ranks."""
        mode = self.cfg.grads
        if mode == "fp32":
            out = torch.empty(self.shard_size, dtype=torch.float32, device=g.device)
            self.comm.reduce_scatter_tensor(out, g, tag="grads", elements=self.padded)
            return out.div_(self.world)
        hs = mode == "tlq_hs"
        if hs:
            g = quant.hadamard(g, self.cfg.hadamard_order)
        rows = g.view(self.world, self.shard_size)
        x = rows if self._identity_perm else rows.index_select(0, self._perm)
        n_intra, n_inter = len(self.topo.intra_ranks), len(self.topo.inter_ranks)
        # Hop 1, inside the node: 8-bit (ULq: 4-bit); x is [intra peers x (inter peers x shard)].
        if n_intra > 1:
            bits = 4 if mode == "ulq" else 8
            partial = self._quantized_all_to_all(
                x.reshape(-1), n_intra, bits, self._key(_STREAM_GRADS_INTRA),
                group=self.topo.intra_group, group_name="intra", tag="grads_intra",
            )
        else:
            partial = x.reshape(-1)
        # Hop 2, across nodes: 4-bit; partial is [inter peers x shard].
        if n_inter > 1:
            shard = self._quantized_all_to_all(
                partial, n_inter, GRAD_BITS_INTER, self._key(_STREAM_GRADS_INTER),
                group=self.topo.inter_group, group_name="inter", tag="grads_inter",
            )
        else:
            shard = partial  # may alias the gradient scratch buffer; it is rewritten every step
        if hs:
            shard = quant.inverse_hadamard(shard, self.cfg.hadamard_order)
        return shard.div_(self.world)

    def _quantized_all_to_all(
        self, x: torch.Tensor, peers: int, bits: int, key: tuple[int, int], *,
        group: Any, group_name: str, tag: str,
    ) -> torch.Tensor:
        """Quantize ``x`` (``peers`` equal rows), send row ``i`` to group rank ``i``, and return the
        sum of the dequantized rows received (this rank's row of every peer)."""
        gs = self.cfg.grad_group
        values, scales = quant.quantize(x, bits, gs, key)
        send = _pack_rows(values, scales, peers)
        recv = torch.empty_like(send)
        self.comm.all_to_all_single(recv, send, group=group, group_name=group_name, tag=tag, elements=x.numel())
        rv, rs = _unpack_rows(recv, values.numel() // peers)
        if bits == 8:
            rv = rv.view(torch.int8)
        return quant.dequantize_sum(rv, rs, gs, packed=bits == 4)

    def _clip(self, grad_shard: torch.Tensor) -> None:
        max_norm = self.spec.grad_clip
        if max_norm <= 0:
            return
        sq = grad_shard.double().square().sum().reshape(1)
        self.comm.all_reduce(sq, tag="grad_norm", elements=1)
        norm = float(sq.sqrt())
        # The same coefficient as torch.nn.utils.clip_grad_norm_.
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            grad_shard.mul_(coef)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def _sync_weights(self) -> None:
        mode = self.cfg.weights
        replica = self.flat
        if mode == "fp32":
            self.comm.all_gather_into_tensor(
                replica, self.master.detach().to(replica.dtype), tag="weights", elements=self.shard_size
            )
            return
        wg = self.cfg.weight_group
        if mode == "qwd":
            # Against the replica's current value: the error of earlier steps is in it, so it is
            # corrected here instead of accumulating.
            x = self.master.detach().to(replica.dtype).float() - replica[self._shard].float()
        else:
            x = self.master.detach()
        values, scales = quant.quantize(x, WEIGHT_BITS, wg, self._key(_STREAM_WEIGHTS))
        send = _pack_rows(values, scales, 1)
        recv = torch.empty(self.world * send.numel(), dtype=torch.uint8, device=send.device)
        self.comm.all_gather_into_tensor(recv, send.reshape(-1), tag="weights", elements=self.shard_size)
        rv, rs = _unpack_rows(recv.view(self.world, -1), values.numel())
        deq = quant.dequantize(rv, rs, wg, packed=True)
        if mode == "qwd":
            replica.add_(deq.to(replica.dtype))
        else:
            replica.copy_(deq)

    # ------------------------------------------------------------------ state

    def _layout(self) -> dict[str, int]:
        return {"world_size": self.world, "rank": self.rank, "numel": self.numel, "shard_size": self.shard_size}

    def state_dict(self) -> dict[str, Any]:
        return {
            KEY_LAYOUT: self._layout(),
            KEY_MASTER: self.master.detach().clone(),
            KEY_REPLICA: self.flat.clone(),
            KEY_OPTIMIZER: self.optimizer.state_dict(),
            KEY_RNG_COUNTER: self._rng_counter,
            KEY_SEED: self.cfg.seed,
        }

    def state_layout(self) -> StateLayout:
        """The fp32 master shard and its AdamW moments are sharded; the replica (identical on every
        rank, padded for the world size) and the counters are replicated; the layout is current."""
        shard = Shard(self.numel, self.shard_size)
        return StateLayout(
            sharded={(KEY_MASTER,): shard, (KEY_OPTIMIZER, "state", 0, "exp_avg"): shard,
                     (KEY_OPTIMIZER, "state", 0, "exp_avg_sq"): shard},
            current=((KEY_LAYOUT,),), padded={(KEY_REPLICA,): self.padded},
        )

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly. A state from another layout (world size, rank, model) cannot be used by
        this shard: then the master shard is re-taken from the current replica (which the caller has
        just loaded with the model's weights), the AdamW state starts fresh, and ``ValueError`` says so."""
        if state.get(KEY_LAYOUT) != self._layout():
            self.master.copy_(self.flat[self._shard].float())
            self.optimizer = torch.optim.AdamW(
                [self.master], lr=self.spec.lr, betas=self.spec.betas, weight_decay=self.spec.weight_decay
            )
            raise ValueError(f"SDP4Bit state is for layout {state.get(KEY_LAYOUT)}, this rank is {self._layout()}; "
                             "kept the model's weights with a fresh optimizer state")
        self.flat.copy_(state[KEY_REPLICA])
        self.master.copy_(state[KEY_MASTER])
        self.optimizer.load_state_dict(state[KEY_OPTIMIZER])
        self._rng_counter = int(state[KEY_RNG_COUNTER])
        if int(state[KEY_SEED]) != self.cfg.seed:
            raise ValueError(f"SDP4Bit state has seed {state[KEY_SEED]}, the spec says {self.cfg.seed}")


def _pack_rows(values: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """One uint8 buffer [rows, bytes]: each row is its values' bytes, then its scales' bytes."""
    return torch.cat((values.view(torch.uint8).reshape(rows, -1), scales.view(torch.uint8).reshape(rows, -1)), dim=1)


def _unpack_rows(buf: torch.Tensor, value_bytes_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack_rows`: (values [rows, bytes] as uint8, scales [rows, groups] fp32)."""
    rows = buf.shape[0]
    values = buf[:, :value_bytes_per_row]
    scales = buf[:, value_bytes_per_row:].contiguous().view(torch.float32).reshape(rows, -1)
    return values, scales


__all__ = ["GRAD_MODES", "VARIANTS", "WEIGHT_MODES", "SDP4Bit", "SDP4BitParams"]
