"""The quantization kernels of vigil/quant.py, single process, CPU (numpy for a reference hash).

Covers: the counter-based noise (equals an independent numpy uint32 implementation, uniform, keyed),
stochastic rounding (unbiased, within one quantum), the clamp range, 4-bit pack/unpack, the
Hadamard transform and its inverse, and the paper's two relative-error arguments (weight
differences vs weights, gradients with vs without Hadamard).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vigil import quant


def _lowbias32_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x = (x * np.uint32(0x7FEB352D)).astype(np.uint32)
    x ^= x >> np.uint32(15)
    x = (x * np.uint32(0x846CA68B)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    return x


def test_noise_is_the_documented_uint32_hash() -> None:
    key = quant.stream_key(7, 1, 2, 3)
    n = 1 << 14
    u = quant.uniform_noise(n, key).numpy()
    idx = np.arange(n, dtype=np.uint32)
    h = _lowbias32_np(_lowbias32_np(idx ^ np.uint32(key[0] & 0xFFFFFFFF)) ^ np.uint32(key[1] & 0xFFFFFFFF))
    ref = (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    assert np.array_equal(u, ref)


def test_noise_uniform_and_keyed() -> None:
    n = 1 << 16
    a = quant.uniform_noise(n, quant.stream_key(0, 1))
    b = quant.uniform_noise(n, quant.stream_key(0, 2))
    assert torch.equal(a, quant.uniform_noise(n, quant.stream_key(0, 1)))  # reproducible
    assert 0.0 <= float(a.min()) and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.01
    assert abs(float(a.var()) - 1 / 12) < 0.005
    hist = torch.histc(a, bins=16, min=0.0, max=1.0)
    assert float((hist / n - 1 / 16).abs().max()) < 0.005
    corr = float(torch.corrcoef(torch.stack((a, b)))[0, 1])
    assert abs(corr) < 0.02
    # Neighbouring elements are not correlated either.
    assert abs(float(torch.corrcoef(torch.stack((a[:-1], a[1:])))[0, 1])) < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_error_within_one_quantum_and_range(bits: int) -> None:
    torch.manual_seed(0)
    group = 128
    x = torch.randn(64 * group) * torch.logspace(-3, 2, 64).repeat_interleave(group)
    x[:group] = 0.0  # an all-zero group must not produce nan
    q, scales = quant.quantize(x, bits, group, quant.stream_key(1), pack=False)
    qmax = (1 << (bits - 1)) - 1
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.numel() == 64
    assert int(q.abs().max()) <= qmax
    # The group maximum maps to +-qmax exactly (its scaled value is an integer).
    assert torch.equal(q.view(-1, group)[1:].abs().amax(1), torch.full((63,), qmax, dtype=torch.int8))
    deq = quant.dequantize(q, scales, group)
    assert torch.isfinite(deq).all()
    bound = (1.0 / scales).repeat_interleave(group)
    assert bool(((deq - x).abs() <= bound * (1 + 1e-5)).all())
    assert torch.equal(deq[:group], torch.zeros(group))


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    torch.manual_seed(1)
    group = 64
    x = torch.randn(4 * group)
    draws = 2000
    acc = torch.zeros_like(x)
    for i in range(draws):
        q, s = quant.quantize(x, bits, group, quant.stream_key(3, i))
        acc += quant.dequantize(q, s, group, packed=bits == 4)
    mean_err = (acc / draws - x).abs()
    quantum = (1.0 / s).repeat_interleave(group)  # scales do not depend on the draw
    # Rounding error per draw is in (-quantum, quantum) with variance <= quantum^2/4: the mean over
    # 2000 draws is within ~5 standard errors of 0; nearest rounding would leave up to quantum/2.
    assert bool((mean_err <= 5 * quantum / (2 * draws**0.5)).all()), float((mean_err / quantum).max())
    # And the single-draw error is really random (not nearest rounding): it changes with the key.
    q1, _ = quant.quantize(x, bits, group, quant.stream_key(3, 0))
    q2, _ = quant.quantize(x, bits, group, quant.stream_key(3, 1))
    assert not torch.equal(q1, q2)


def test_pack_unpack_roundtrip() -> None:
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(64)[torch.randperm(1024)]
    p = quant.pack4(q)
    assert p.dtype == torch.uint8 and p.numel() == 512
    assert torch.equal(quant.unpack4(p), q)
    # Layout: low nibble first, offset binary.
    assert quant.pack4(torch.tensor([-8, 7], dtype=torch.int8)).item() == 0xF0
    assert quant.pack4(torch.tensor([1, -1], dtype=torch.int8)).item() == (9 | 7 << 4)
    # quantize(pack=True) is quantize(pack=False) packed, and dequantize(packed=True) agrees.
    x = torch.randn(2048)
    key = quant.stream_key(9)
    qp, s = quant.quantize(x, 4, 256, key)
    qu, s2 = quant.quantize(x, 4, 256, key, pack=False)
    assert torch.equal(quant.unpack4(qp), qu) and torch.equal(s, s2)
    assert torch.equal(quant.dequantize(qp, s, 256, packed=True), quant.dequantize(qu, s, 256))


def test_dequantize_sum_is_row_sum() -> None:
    x = torch.randn(3, 1024)
    for bits in (4, 8):
        qs, ss = zip(*(quant.quantize(x[i], bits, 128, quant.stream_key(i)) for i in range(3)), strict=True)
        q, s = torch.stack(qs), torch.stack(ss)
        want = sum(quant.dequantize(q[i], s[i], 128, packed=bits == 4) for i in range(3))
        assert torch.equal(quant.dequantize_sum(q, s, 128, packed=bits == 4), want)


def test_hadamard() -> None:
    h = quant.hadamard_matrix(32)
    assert torch.equal(h, h.T) and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h, 32 * torch.eye(32))
    # Integer inputs: every sum is exact in fp32, so the inverse is bit-exact.
    xi = torch.randint(-1000, 1000, (4096,)).float()
    assert torch.equal(quant.inverse_hadamard(quant.hadamard(xi)), xi)
    x = torch.randn(4096)
    assert torch.allclose(quant.inverse_hadamard(quant.hadamard(x)), x, atol=1e-6)
    # Blockwise: the transform of a block depends on that block alone.
    y = x.clone()
    y[32:64] += 1.0
    assert torch.equal(quant.hadamard(y)[:32], quant.hadamard(x)[:32])
    assert torch.equal(quant.hadamard(y)[64:], quant.hadamard(x)[64:])
    with pytest.raises(ValueError):
        quant.hadamard(torch.randn(33))


def test_quantize_rejects_bad_groups() -> None:
    with pytest.raises(ValueError):
        quant.quantize(torch.randn(100), 4, 128, (0, 0))
    with pytest.raises(ValueError):
        quant.quantize(torch.randn(128), 3, 128, (0, 0))


def test_weight_differences_quantize_better_than_weights() -> None:
    """The qWD argument: an AdamW-sized update is small next to the weights, so for the same 4 bits
    the replica error of quantizing the difference is far smaller than quantizing the weights."""
    torch.manual_seed(2)
    w_old = torch.randn(1 << 16) * 0.02
    w_new = w_old - 1e-3 * torch.sign(torch.randn_like(w_old))  # one Adam-like step of lr 1e-3
    key = quant.stream_key(4)
    qw, sw = quant.quantize(w_new, 4, 2048, key)
    err_w = quant.relative_error(quant.dequantize(qw, sw, 2048, packed=True), w_new)
    d = w_new - w_old
    qd, sd = quant.quantize(d, 4, 2048, key)
    err_wd = quant.relative_error(w_old + quant.dequantize(qd, sd, 2048, packed=True), w_new)
    assert err_wd < err_w / 5, (err_wd, err_w)


def test_hadamard_reduces_gradient_quantization_error() -> None:
    """The TLq-HS argument: gradients with outliers quantize badly per group; the Hadamard transform
    spreads each outlier over its block of 32, shrinking the group max and the error."""
    torch.manual_seed(3)
    g = torch.randn(1 << 16) * 1e-3
    outliers = torch.randint(0, g.numel(), (g.numel() // 200,))
    g[outliers] *= 100.0
    key = quant.stream_key(5)
    q, s = quant.quantize(g, 4, 128, key)
    err_plain = quant.relative_error(quant.dequantize(q, s, 128, packed=True), g)
    gh = quant.hadamard(g)
    qh, sh = quant.quantize(gh, 4, 128, key)
    err_hs = quant.relative_error(quant.inverse_hadamard(quant.dequantize(qh, sh, 128, packed=True)), g)
    assert err_hs < 0.8 * err_plain, (err_hs, err_plain)


@pytest.mark.slow  # compiling the kernels takes ~40 s of one shared core
@pytest.mark.beside  # one core: the other runs the parallel tests meanwhile
def test_compiled_kernels_match_eager() -> None:
    """torch.compile'd kernels (when a compiler is available) give the same bits as eager ones."""
    x = torch.randn(8 * 256)
    key = quant.stream_key(6)
    eager = [quant.quantize(x, b, 256, key) for b in (4, 8)]
    deq_e = [quant.dequantize(q, s, 256, packed=b == 4) for (q, s), b in zip(eager, (4, 8), strict=True)]
    try:
        if not quant.set_compiled(True):
            pytest.skip("torch.compile is not available here")
        comp = [quant.quantize(x, b, 256, key) for b in (4, 8)]
        deq_c = [quant.dequantize(q, s, 256, packed=b == 4) for (q, s), b in zip(comp, (4, 8), strict=True)]
        stacked = quant.dequantize_sum(torch.stack([eager[0][0]] * 2), torch.stack([eager[0][1]] * 2), 256, packed=True)
    finally:
        quant.set_compiled(False)
    for (qe, se), (qc, sc) in zip(eager, comp, strict=True):
        assert torch.equal(qe, qc)
        # Inductor may compute qmax/absmax as qmax*(1/absmax): allow one ulp in the scales.
        assert torch.allclose(se, sc, rtol=2e-7, atol=0)
    for a, b in zip(deq_e, deq_c, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert torch.allclose(stacked, 2 * deq_e[0], rtol=1e-6, atol=0)
