"""Flat parameter buffers shared by the strategies that communicate whole models or updates.

:class:`FlatParams` re-seats a module's trainable parameters as views into one contiguous,
zero-padded buffer, so a collective can read or write the whole model in place (an all-gather
straight into the parameters, an all-reduce of the model without a copy) and vectorized code can
treat the model as one tensor. The optimizers keep referring to the same ``Parameter`` objects;
only their storage moves. Do not ``.to()`` the module afterwards (that would re-allocate the
parameters and silently detach them from the buffer).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vigil.comm import Comm


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The distinct trainable parameters of ``module`` in registration order (tied weights once)."""
    return [p for p in module.parameters() if p.requires_grad]


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Give every rank ``src``'s parameters and buffers (one flat broadcast per dtype, tag ``init``)."""
    if comm.world_size <= 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, src=src, tag="init")
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


class FlatParams:
    """Trainable parameters as views into one flat buffer of length ``padded`` (>= ``numel``).

    ``pad_to``: the padded length is a multiple of it (e.g. world size x chunk, so every rank owns
    an equal shard). Padding elements stay zero: they are never read as parameters.
    """

    def __init__(self, params: list[nn.Parameter], pad_to: int = 1) -> None:
        if not params:
            raise ValueError("no trainable parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters must share one dtype and device, got {dtypes} on {devices}")
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.padded = -(-self.numel // pad_to) * pad_to
        self.buffer = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.buffer[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = self.buffer[offset : offset + n].view_as(p)
                offset += n

    @property
    def data(self) -> torch.Tensor:
        """The real (unpadded) parameters as one flat view."""
        return self.buffer[: self.numel]

    def grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradients as one flat, padded tensor (zeros where a parameter has no gradient)."""
        if out is None:
            out = torch.zeros_like(self.buffer)
        else:
            out[self.numel :].zero_()
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            if p.grad is None:
                out[offset : offset + n].zero_()
            else:
                out[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return out

    def set_grads(self, flat: torch.Tensor) -> None:
        """Point every parameter's ``.grad`` at its slice of ``flat`` (no copy)."""
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n


def module_with(module: nn.Module, flat: torch.Tensor, cache: nn.Module | None = None) -> nn.Module:
    """A copy of ``module`` (or ``cache``, reused) whose trainable parameters hold ``flat``'s values."""
    target = cache if cache is not None else copy.deepcopy(module)
    offset = 0
    with torch.no_grad():
        for p in trainable(target):
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    return target
