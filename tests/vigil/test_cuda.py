"""The trainer's kernels and timings on a real CUDA GPU: the same math as on the CPU.

Needs: a CUDA GPU (skipped without one, with that reason; CI's machine has none, so these ran on a
lent H100 when they were written: see the commit). Single process; the comm test makes a 1-rank
NCCL group on a free port.
"""

from __future__ import annotations

import os

import pytest
import torch

from vigil import quant
from vigil.contract.probe import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _inputs(n: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # heavy tails and a few exact zeros: the cases where rounding and absmax scales differ first
    x = torch.randn(n, generator=g) * torch.where(torch.rand(n, generator=g) < 0.01, 50.0, 1.0)
    x[::4097] = 0.0
    return x


@pytest.mark.parametrize(("bits", "group"), [(8, 128), (4, 128), (4, 2048)])
def test_quantize_is_bitwise_the_same_on_cpu_and_gpu(bits: int, group: int) -> None:
    x = _inputs()
    key = quant.stream_key(11, 3, bits)
    q_cpu, s_cpu = quant.quantize(x, bits, group, key)
    q_gpu, s_gpu = quant.quantize(x.cuda(), bits, group, key)
    assert torch.equal(s_cpu, s_gpu.cpu())
    assert torch.equal(q_cpu, q_gpu.cpu())  # the counter-based noise and the rounding, bit for bit
    packed = bits == 4
    d_cpu = quant.dequantize(q_cpu, s_cpu, group, packed=packed)
    d_gpu = quant.dequantize(q_gpu, s_gpu, group, packed=packed)
    assert torch.equal(d_cpu, d_gpu.cpu())
    rows_cpu, scales_cpu = torch.stack([q_cpu, q_cpu.flip(0)]), torch.stack([s_cpu, s_cpu.flip(0)])
    summed = quant.dequantize_sum(rows_cpu.cuda(), scales_cpu.cuda(), group, packed=packed)
    assert torch.equal(quant.dequantize_sum(rows_cpu, scales_cpu, group, packed=packed), summed.cpu())


def test_noise_pack_and_hadamard_agree_on_cpu_and_gpu() -> None:
    key = quant.stream_key(5, 1)
    assert torch.equal(quant.uniform_noise(1 << 20, key), quant.uniform_noise(1 << 20, key, "cuda").cpu())
    q = torch.randint(-8, 8, (1 << 16,), dtype=torch.int8)
    assert torch.equal(quant.pack4(q), quant.pack4(q.cuda()).cpu())
    assert torch.equal(quant.unpack4(quant.pack4(q.cuda())).cpu(), q)
    x = _inputs(1 << 16)
    # A matmul of +-1 entries: the same sums, possibly accumulated in another order (fp32, no TF32).
    torch.backends.cuda.matmul.allow_tf32 = False
    h_cpu, h_gpu = quant.hadamard(x), quant.hadamard(x.cuda()).cpu()
    assert torch.allclose(h_cpu, h_gpu, rtol=1e-5, atol=1e-4)
    assert torch.allclose(quant.inverse_hadamard(quant.hadamard(x.cuda())).cpu(), x, rtol=1e-5, atol=1e-4)


def test_comm_times_gpu_collectives_with_cuda_events_without_a_sync() -> None:
    """The layer records CUDA events around the call and resolves them only at drain: the duration
    covers the collective's GPU work (a 256 MB all-reduce takes well over 10 microseconds)."""
    import torch.distributed as dist

    from vigil.comm import Comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        comm = Comm.from_process_group()
        # One GPU, so one rank: make the layer issue the real NCCL all-reduce anyway (it skips the
        # call in a group of one), so the events time a real collective kernel.
        comm._group_size = lambda group: 2  # type: ignore[method-assign]
        t = torch.ones(64 << 20, device="cuda")
        comm.step = 7
        comm.all_reduce(t, tag="grads")
        assert comm.records == [] and len(comm._pending) == 1  # nothing resolved yet: no sync
        records = comm.drain()
        assert len(records) == 1 and comm._pending == []
        r = records[0]
        assert (r.step, r.op, r.tag, r.payload_bytes) == (7, "all_reduce", "grads", 256 << 20)
        assert r.duration_s > 0.0
        assert float(t[0]) == 1.0  # one rank: the sum is the input
    finally:
        dist.destroy_process_group()
