"""Quantization kernels for SDP4Bit: symmetric absmax group quantizer with stochastic rounding,
4-bit packing and the blockwise Hadamard transform.

Everything is vectorized torch, the same math on CPU and GPU:

* **Quantizer** (ALGORITHMS.md §2): per group of ``group`` consecutive elements,
  ``scale = (2^(b-1)-1) / max|x|``, ``q = clamp(floor(x*scale + u), -qmax, qmax)`` with
  ``u ~ U[0, 1)`` (stochastic rounding, so ``E[q/scale] = x``), one fp32 scale per group.
  Dequantize: ``q / scale``. Values are int8 in [-qmax, qmax]; 4-bit values travel packed two per
  byte (offset binary: nibble = q + 8).
* **Noise**: the random numbers are the bottleneck of a stochastic quantizer, so ``u`` is not drawn
  from a ``torch.Generator`` but computed as a counter-based hash of (element index, key): two
  rounds of Wellons' ``lowbias32`` integer mixer in int32 arithmetic (torch int32 multiplication
  wraps modulo 2^32 on CPU and CUDA, which is exactly the uint32 arithmetic the mixer needs;
  logical right shifts are arithmetic shifts followed by a mask). The noise is therefore a pure
  function of the key and the element index: reproducible across ranks, devices, restarts, and
  between the eager and the compiled path, and it fuses into the quantizer under ``torch.compile``
  (no noise tensor is ever materialised there). The element index is taken modulo 2^32.
  A key is derived from ``(seed, stream ids...)`` with :func:`stream_key` (splitmix64 in Python).
* **Hadamard**: blockwise unnormalised Sylvester Hadamard of order 32 (entries +-1), applied as
  ``x.view(-1, 32) @ H``; ``H @ H = 32 I``, so the inverse is ``H(.) / 32``.

:func:`set_compiled` switches quantize/dequantize to ``torch.compile``-fused versions (falling
back to eager, with a warning, if compilation fails); eager is the default because compiling costs
tens of seconds per process and shape, which small runs and tests cannot amortise. See
``python -m vigil.bench.kernels`` for the measured speeds of both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_MASK32 = (1 << 32) - 1
_M1 = 0x7FEB352D  # lowbias32 multipliers (Chris Wellons, "hash-prospector")
_M2 = 0x846CA68B - (1 << 32)  # the same bits as a signed int32
_U24 = 1.0 / (1 << 24)


def qmax_for(bits: int) -> int:
    """Largest quantized magnitude: 7 for 4-bit, 127 for 8-bit."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return (1 << (bits - 1)) - 1


def _to_int32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def stream_key(seed: int, *ids: int) -> tuple[int, int]:
    """Two int32 keys for the noise stream named by ``seed`` and ``ids`` (e.g. rank, call counter).

    Different ``(seed, ids)`` give unrelated streams; the same ones give the same noise anywhere.
    """
    h = _splitmix64(seed & 0xFFFFFFFFFFFFFFFF)
    for i in ids:
        h = _splitmix64(h ^ (i & 0xFFFFFFFFFFFFFFFF))
    return _to_int32(h), _to_int32(h >> 32)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """In place on int32 ``x``: ">> k" then mask is a logical shift; "*" wraps modulo 2^32.
    (In-place ops: in eager mode every temporary of this size is an allocation and its page
    faults, which were measured to cost more than the arithmetic.)"""
    t = x >> 16
    x ^= t.bitwise_and_(0xFFFF)
    x *= _M1
    t = x >> 15
    x ^= t.bitwise_and_(0x1FFFF)
    x *= _M2
    t = x >> 16
    x ^= t.bitwise_and_(0xFFFF)
    return x


def _uniform_from_index(idx: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """U[0, 1) float32 noise (24 random bits) from int32 element indices and a 2-element int32 key."""
    h = _lowbias32_(idx ^ keys[0])
    h ^= keys[1]
    h = _lowbias32_(h)
    h >>= 8
    h &= 0xFFFFFF
    return h.to(torch.float32).mul_(_U24)


def _keys_tensor(key: tuple[int, int], device: torch.device) -> torch.Tensor:
    # A tensor, not Python ints, so the compiled kernels do not specialise (recompile) per key.
    return torch.tensor([_to_int32(key[0]), _to_int32(key[1])], dtype=torch.int32, device=device)


def uniform_noise(numel: int, key: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The U[0, 1) noise the quantizer uses for elements ``0 .. numel-1`` of stream ``key``."""
    idx = torch.arange(numel, dtype=torch.int32, device=device)
    return _uniform_from_index(idx, _keys_tensor(key, torch.device(device)))


# ----------------------------------------------------------------------------- kernels
# Each kernel is one function that torch.compile can fuse as a whole. The quantizer stops at int8
# values: packing is a separate, cheap pass (the fused quantize+pack kernel inductor generates
# writes a float intermediate and was measured slower than the two passes).


def _quantize_kernel(x: torch.Tensor, keys: torch.Tensor, qmax: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.reshape(-1, group).to(torch.float32)
    absmax = xg.abs().amax(dim=1, keepdim=True)
    # A group of zeros (or denormals) must not produce inf/nan: its values quantize to 0 anyway.
    scale = qmax / absmax.clamp_min(1e-30)
    idx = torch.arange(xg.numel(), dtype=torch.int32, device=x.device).view_as(xg)
    y = xg * scale
    y += _uniform_from_index(idx, keys)
    q = y.floor_().clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(-1), scale.reshape(-1)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    # Pairs of int8 read as one little-endian int16: nibble = (q + 8) & 15 = (q ^ 8) & 15 in two's
    # complement, for both bytes at once; then fold the high byte's nibble next to the low one's.
    # (The byte-pair view assumes a little-endian machine, like every CPU and GPU torch runs on.)
    t = (q.reshape(-1).view(torch.int16) ^ 0x0808) & 0x0F0F
    return ((t | (t >> 4)) & 0xFF).to(torch.uint8)


def _unpack4_float(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pi = p.to(torch.int32)
    return ((pi & 15) - 8).to(torch.float32), ((pi >> 4) - 8).to(torch.float32)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    # The inverse trick: widen each byte to int16 (little-endian pair [lo, hi]), move the high
    # nibble into the high byte, mask, and read the pair back as two int8 values minus 8.
    w = p.to(torch.int16)
    w |= w << 4
    w &= 0x0F0F
    q = w.view(torch.int8)
    q -= 8
    return q


def _dequantize_eager(q: torch.Tensor, scales: torch.Tensor, group: int, packed: bool) -> torch.Tensor:
    # Eager: unpacking to int8 first is several times faster than the float-pair form below,
    # which is the one inductor fuses best. Both compute float(q) / scale: the same bits.
    if packed:
        q = _unpack4(q)
    return q.reshape(-1, group).to(torch.float32).div_(scales.reshape(-1, 1)).reshape(-1)


def _dequantize_sum_eager(q: torch.Tensor, scales: torch.Tensor, group: int, packed: bool) -> torch.Tensor:
    peers = q.shape[0]
    if packed:
        q = _unpack4(q)
    return q.reshape(peers, -1, group).to(torch.float32).div_(scales.reshape(peers, -1, 1)).sum(dim=0).reshape(-1)


def _dequantize_kernel(q: torch.Tensor, scales: torch.Tensor, group: int, packed: bool) -> torch.Tensor:
    s = scales.reshape(-1, 1)
    if packed:
        lo, hi = _unpack4_float(q.reshape(-1, group // 2))
        return torch.stack((lo / s, hi / s), dim=-1).reshape(-1)
    return (q.reshape(-1, group).to(torch.float32) / s).reshape(-1)


def _dequantize_sum_kernel(q: torch.Tensor, scales: torch.Tensor, group: int, packed: bool) -> torch.Tensor:
    """``q``: [peers, bytes], ``scales``: [peers, groups] -> sum over peers of the dequantized rows."""
    peers = q.shape[0]
    s = scales.reshape(peers, -1, 1)
    if packed:
        lo, hi = _unpack4_float(q.reshape(peers, -1, group // 2))
        deq = torch.stack((lo / s, hi / s), dim=-1)
    else:
        deq = q.reshape(peers, -1, group).to(torch.float32) / s
    return deq.sum(dim=0).reshape(-1)


_EAGER: dict[str, Callable[..., Any]] = {
    "quantize": _quantize_kernel,
    "dequantize": _dequantize_eager,
    "dequantize_sum": _dequantize_sum_eager,
}
_TO_COMPILE: dict[str, Callable[..., Any]] = {
    "quantize": _quantize_kernel,
    "dequantize": _dequantize_kernel,
    "dequantize_sum": _dequantize_sum_kernel,
}
_impl: dict[str, Callable[..., Any]] = dict(_EAGER)
_compiled_on = False


def set_compiled(enabled: bool) -> bool:
    """Use ``torch.compile``-fused kernels (True) or eager ones (False). Returns whether compiled
    kernels are now in use: compilation is tried once on a small input, and on failure the eager
    kernels stay (hardware and toolchains differ; a missing compiler must not stop training)."""
    global _compiled_on
    if not enabled:
        _impl.update(_EAGER)
        _compiled_on = False
        return False
    if _compiled_on:
        return True
    try:
        fns = {name: torch.compile(fn, dynamic=True) for name, fn in _TO_COMPILE.items()}
        x = torch.randn(4 * 256)
        k = _keys_tensor((1, 2), x.device)
        for qmax in (7, 127):
            q, s = fns["quantize"](x, k, qmax, 256)
            if qmax == 7:
                q = _pack4(q)
            fns["dequantize"](q, s, 256, qmax == 7)
            fns["dequantize_sum"](q.view(2, -1), s.view(2, -1), 256, qmax == 7)
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
        log.warning("torch.compile of the quantization kernels failed, staying eager: %s", exc)
        return set_compiled(False)
    _impl.update(fns)
    _compiled_on = True
    return True


def compiled() -> bool:
    """Whether the compiled kernels are in use."""
    return _compiled_on


# ----------------------------------------------------------------------------- public API


def _check_group(numel: int, group: int, bits: int) -> None:
    if group <= 0 or numel % group:
        raise ValueError(f"numel {numel} must be a positive multiple of the group size {group}")
    if bits == 4 and group % 2:
        raise ValueError(f"4-bit groups must have an even size, got {group}")


def quantize(
    x: torch.Tensor, bits: int, group: int, key: tuple[int, int], *, pack: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastically quantize ``x`` (flattened; numel a multiple of ``group``) to ``bits`` bits.

    Returns ``(values, scales)``: values int8 in [-qmax, qmax] (8-bit, or 4-bit with
    ``pack=False``) or uint8 with two 4-bit values per byte (4-bit, ``pack=True``); scales fp32,
    one per group, ``qmax / max|x|``. The rounding noise is the stream ``key`` (see :func:`stream_key`).
    """
    qmax = qmax_for(bits)
    _check_group(x.numel(), group, bits)
    q, scales = _impl["quantize"](x.reshape(-1), _keys_tensor(key, x.device), qmax, group)
    if pack and bits == 4:
        q = _pack4(q)
    return q, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, group: int, *, packed: bool = False) -> torch.Tensor:
    """fp32 ``values / scale`` per group, flattened; ``packed``: values are 4-bit pairs in uint8."""
    return _impl["dequantize"](values.reshape(-1), scales.reshape(-1), group, packed)


def dequantize_sum(values: torch.Tensor, scales: torch.Tensor, group: int, *, packed: bool = False) -> torch.Tensor:
    """Dequantize each row of ``values`` [peers, n] with its row of ``scales`` and sum the rows
    (in row order, so every caller gets the same bits)."""
    return _impl["dequantize_sum"](values, scales, group, packed)


def pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] (even count) -> uint8, two per byte (low nibble first), offset by 8."""
    if q.numel() % 2:
        raise ValueError("pack4 needs an even number of values")
    return _pack4(q.reshape(-1).to(torch.int8).contiguous())


def unpack4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack4`: uint8 -> int8, twice as many values."""
    return _unpack4(p.reshape(-1))


_H_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard_matrix(order: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix of ``order`` (a power of two), entries +-1, symmetric."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {order}")
    dev = torch.device(device)
    cached = _H_CACHE.get((order, dev, dtype))
    if cached is None:
        h = torch.ones(1, 1, dtype=dtype)
        while h.shape[0] < order:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        cached = _H_CACHE[(order, dev, dtype)] = h.to(dev)
    return cached


def hadamard(x: torch.Tensor, order: int = 32) -> torch.Tensor:
    """Blockwise Hadamard transform of consecutive blocks of ``order`` elements (flattened)."""
    if x.numel() % order:
        raise ValueError(f"numel {x.numel()} must be a multiple of the Hadamard order {order}")
    h = hadamard_matrix(order, x.device, x.dtype)
    return (x.reshape(-1, order) @ h).reshape(-1)


def inverse_hadamard(x: torch.Tensor, order: int = 32) -> torch.Tensor:
    """Inverse of :func:`hadamard`: ``H(x) / order``."""
    return hadamard(x, order).div_(order)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (the paper's relative quantization error)."""
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact).clamp_min(1e-30))


__all__ = [
    "compiled",
    "dequantize",
    "dequantize_sum",
    "hadamard",
    "hadamard_matrix",
    "inverse_hadamard",
    "pack4",
    "qmax_for",
    "quantize",
    "relative_error",
    "set_compiled",
    "stream_key",
    "uniform_noise",
    "unpack4",
]
