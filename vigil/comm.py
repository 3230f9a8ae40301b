"""The communication layer: every collective of the trainer and its optimizers passes through here.

Each call is timed, its payload and ring-equivalent wire bytes counted, and tagged with op, group,
tag and step. The train loop drains the records once per step and hands them to the telemetry path.
Optimizers never call ``torch.distributed`` directly.

Timing: on CPU tensors, wall clock around the (blocking) call. On CUDA tensors, a pair of CUDA
events recorded on the current stream around the call; they are read only when :meth:`Comm.drain`
runs (once per step), so recording never forces a device sync in the middle of a step.

Byte accounting, per call and per rank:

* ``payload_bytes``: the bytes of model data this rank contributes to the collective, in the form
  actually sent (compressed, packed): the input of an all-reduce, a reduce-scatter or an
  all-to-all; this rank's shard for an all-gather; the tensor for a broadcast. Summed over a step
  and divided by the model size this gives ALGORITHMS.md's "b/p/step" (fp32 all-reduce = 32).
  Note that a reduce-scatter followed by an all-gather of the reduced shard (a decomposed
  all-reduce) counts ``1 + 1/n`` times the all-reduce's payload, although it moves exactly the
  same wire bytes: the all-gather's contribution is counted, the all-reduce's implicit result
  distribution is not.
* ``wire_bytes``: what a ring algorithm sends from this rank: 2 (n-1)/n x payload for all-reduce,
  (n-1)/n x input for reduce-scatter and all-to-all, (n-1) x input for all-gather.
* ``elements``: the number of model elements the message stands for (a 1-bit message of 1000
  gradient values has ``elements=1000``), so ``8 * payload_bytes / elements`` is bits per element.

Communication that does not go through these methods (DDP communication hooks, which call
``torch.distributed`` from inside PyTorch) is timed by the caller and entered with
:meth:`Comm.record_external`; records may be added from another thread (future callbacks).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call of this rank."""

    step: int
    seq: int
    op: str
    group: str
    tag: str
    payload_bytes: int
    wire_bytes: int
    elements: int
    duration_s: float
    ts: float


# torch 2.13 renamed the single-tensor all-gather / reduce-scatter (the old names warn); older torch
# only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rs_by_all_to_all(input: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> bool:
    """Whether to reduce-scatter as an all-to-all plus a local sum: on gloo, for sums and means.

    gloo's reduce-scatter runs a whole all-reduce and keeps a chunk (measured: the same bytes on the
    wire as ``all_reduce``, 2 (n-1)/n of the input per rank, twice a ring reduce-scatter's). An
    all-to-all moves each chunk straight to its owner, (n-1)/n of the input, and the owner sums
    the n chunks it receives in rank order (so the result is the same on every run).
    """
    return (not input.is_cuda and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            and dist.get_backend(group) == dist.Backend.GLOO)


def _reduce_scatter_by_all_to_all(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None, n: int
) -> None:
    chunks = torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    dist.all_to_all_single(chunks, input.reshape(-1).contiguous(), group=group)
    rows = chunks.view(n, -1)
    acc = rows[0].clone()
    for r in range(1, n):  # n chunks, summed in rank order
        acc.add_(rows[r])
    if op == dist.ReduceOp.AVG:
        acc.div_(n)
    output.copy_(acc.view(output.shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _PendingCuda:
    """A record whose duration is still two CUDA events on the stream."""

    step: int
    seq: int
    op: str
    group: str
    tag: str
    payload_bytes: int
    wire_bytes: int
    elements: int
    start: Any  # torch.cuda.Event
    end: Any
    ts: float

    def resolve(self) -> CollectiveRecord:
        self.end.synchronize()
        duration = self.start.elapsed_time(self.end) / 1e3
        return CollectiveRecord(
            self.step, self.seq, self.op, self.group, self.tag, self.payload_bytes, self.wire_bytes,
            self.elements, duration, self.ts,
        )


@dataclass
class Comm:
    """Timed, byte-counting wrapper over ``torch.distributed`` for one rank."""

    rank: int = 0
    world_size: int = 1
    step: int = 0
    records: list[CollectiveRecord] = field(default_factory=list)
    _seq: int = 0
    _pending: list[_PendingCuda] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_process_group(cls) -> Comm:
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size())
        return cls()

    def set_step(self, step: int) -> None:
        with self._lock:
            self.step = step
            self._seq = 0

    def drain(self) -> list[CollectiveRecord]:
        """All records since the last drain, in call order; resolves pending CUDA timings."""
        with self._lock:
            out, self.records = self.records, []
            pending, self._pending = self._pending, []
        if pending:
            out.extend(p.resolve() for p in pending)
            out.sort(key=lambda r: (r.step, r.seq))
        return out

    def _group_size(self, group: dist.ProcessGroup | None) -> int:
        return dist.get_world_size(group) if group is not None else self.world_size

    # -- timing ------------------------------------------------------------------------------------

    @staticmethod
    def _start(t: torch.Tensor) -> Any:
        if t.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _record(
        self, op: str, group_name: str, tag: str, payload: int, wire: int, elements: int, start: Any
    ) -> None:
        if isinstance(start, float):
            duration = time.perf_counter() - start
            end = None
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            duration = 0.0
        with self._lock:
            seq = self._seq
            self._seq += 1
            if end is None:
                self.records.append(
                    CollectiveRecord(self.step, seq, op, group_name, tag, payload, wire, elements, duration, time.time())
                )
            else:
                self._pending.append(
                    _PendingCuda(self.step, seq, op, group_name, tag, payload, wire, elements, start, end, time.time())
                )

    def record_external(
        self, op: str, *, group_name: str = "world", tag: str = "", payload_bytes: int, wire_bytes: int,
        elements: int, duration_s: float,
    ) -> None:
        """Enter a collective that was issued and timed elsewhere (e.g. inside a DDP comm hook).

        Thread-safe: future callbacks may call it from a communication thread.
        """
        with self._lock:
            seq = self._seq
            self._seq += 1
            self.records.append(
                CollectiveRecord(
                    self.step, seq, op, group_name, tag, int(payload_bytes), int(wire_bytes), int(elements),
                    float(duration_s), time.time(),
                )
            )

    # -- collectives -------------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        *,
        group: dist.ProcessGroup | None = None,
        group_name: str = "world",
        tag: str = "",
        elements: int | None = None,
    ) -> torch.Tensor:
        """In-place all-reduce. Ring wire bytes: 2 (n-1)/n x payload."""
        n = self._group_size(group)
        payload = _nbytes(tensor)
        t0 = self._start(tensor)
        if n > 1:
            dist.all_reduce(tensor, op=op, group=group)
        wire = int(2 * (n - 1) / n * payload)
        self._record("all_reduce", group_name, tag, payload, wire, tensor.numel() if elements is None else elements, t0)
        return tensor

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, group: dist.ProcessGroup | None = None,
        group_name: str = "world", tag: str = "", elements: int | None = None,
    ) -> torch.Tensor:
        """In-place broadcast from ``src``. Wire bytes: the payload (pipelined chain)."""
        n = self._group_size(group)
        payload = _nbytes(tensor)
        t0 = self._start(tensor)
        if n > 1:
            dist.broadcast(tensor, src=src, group=group)
        self._record("broadcast", group_name, tag, payload, payload if n > 1 else 0,
                     tensor.numel() if elements is None else elements, t0)
        return tensor

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
        group_name: str = "world", tag: str = "", elements: int | None = None,
    ) -> torch.Tensor:
        """``output`` = concatenation of every rank's ``input``. Payload: this rank's input; ring wire: (n-1) x input."""
        n = self._group_size(group)
        payload = _nbytes(input)
        t0 = self._start(input)
        if n > 1:
            _all_gather_single(output, input, group=group)
        else:
            output.copy_(input.reshape(output.shape))
        self._record("all_gather", group_name, tag, payload, (n - 1) * payload,
                     input.numel() if elements is None else elements, t0)
        return output

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *,
        group: dist.ProcessGroup | None = None, group_name: str = "world", tag: str = "", elements: int | None = None,
    ) -> torch.Tensor:
        """``output`` = this rank's chunk of the reduction of every rank's ``input``. Ring wire: (n-1)/n x input."""
        n = self._group_size(group)
        payload = _nbytes(input)
        t0 = self._start(input)
        if n > 1 and _rs_by_all_to_all(input, op, group):
            _reduce_scatter_by_all_to_all(output, input, op, group, n)
        elif n > 1:
            _reduce_scatter_single(output, input, op=op, group=group)
        else:
            output.copy_(input.reshape(output.shape))
        self._record("reduce_scatter", group_name, tag, payload, int((n - 1) / n * payload),
                     input.numel() if elements is None else elements, t0)
        return output

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
        group_name: str = "world", tag: str = "", elements: int | None = None,
    ) -> torch.Tensor:
        """Equal-split all-to-all. Payload: this rank's input; wire: the (n-1)/n of it that leaves the rank."""
        n = self._group_size(group)
        payload = _nbytes(input)
        t0 = self._start(input)
        if n > 1:
            dist.all_to_all_single(output, input, group=group)
        else:
            output.copy_(input)
        self._record("all_to_all", group_name, tag, payload, int((n - 1) / n * payload),
                     input.numel() if elements is None else elements, t0)
        return output
