"""PowerSGD and half-precision DDP hooks, counted by the communication layer.

Needs torch with gloo; 2-rank tests run through ``harness.run_ranks`` (processes on 127.0.0.1,
free port, under a timeout). Checks that the counting wrapper leaves the hooks' results bit for bit
unchanged, and that the counted payload is what the hooks send (derived independently here, and
cross-checked with PowerSGD's own compression statistics).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from tests.vigil.optim.common import batch, bits_per_element, flat_params, make, tiny_mlp, train_step
from tests.vigil.optim.harness import run_ranks
from vigil.optim.hooks import _CountingDist, half_hook_for_backend

TIMEOUT = 120
START, RANK, STEPS = 3, 1, 7


def _expected_powersgd_elements(model: torch.nn.Module, rank: int, rate: float = 2.0) -> int:
    """Elements all-reduced per step once PowerSGD runs: (n + m) r per compressed matrix, n m otherwise."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * rate < n * m else n * m
    return total


def _powersgd(rank: int, world: int) -> dict:
    # Ours: counted hook inside the strategy.
    strategy = make("powersgd", tiny_mlp(), rank=RANK, start_iter=START)
    strategy.comm.drain()
    per_step, params = [], []
    for step in range(STEPS):
        train_step(strategy, rank, step)
        per_step.append(sum(r.payload_bytes for r in strategy.comm.drain() if r.tag == "grads"))
        params.append(flat_params(strategy.module))
    stats = strategy.hook_state.compression_stats()

    # Reference: the hook registered on plain DDP, uncounted, same AdamW.
    model = tiny_mlp()
    ddp = DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=START)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    ref = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        ref.append(flat_params(model))
    return {"per_step": per_step, "params": params, "ref": ref, "stats": stats,
            "expected": _expected_powersgd_elements(tiny_mlp(), RANK), "n": sum(p.numel() for p in model.parameters())}


@pytest.mark.timeout(TIMEOUT)
def test_powersgd_counted_payload_and_unchanged_results() -> None:
    results = run_ranks(2, _powersgd, timeout=TIMEOUT)
    for res in results:
        # The counting wrapper changes nothing: same bits as the hook on plain DDP.
        for step in range(STEPS):
            assert torch.equal(res["params"][step], res["ref"][step]), step
        # fp32 all-reduce before start_iter, then P, Q and the uncompressed vectors.
        assert res["per_step"][:START] == [4 * res["n"]] * START
        assert res["per_step"][START:] == [4 * res["expected"]] * (STEPS - START)
        assert res["expected"] < res["n"]
        # PowerSGD's own statistics count the same elements after compression starts.
        _, before, after = res["stats"]
        assert after == res["expected"] * (STEPS - START)
        assert before == res["n"] * (STEPS - START)
    for step in range(STEPS):
        assert torch.equal(results[0]["params"][step], results[1]["params"][step])


def _half(rank: int, world: int) -> dict:
    strategy = make("fp16_compress", tiny_mlp())
    strategy.comm.drain()
    records, params = [], []
    for step in range(3):
        train_step(strategy, rank, step)
        records.extend(strategy.comm.drain())
        params.append(flat_params(strategy.module))
    return {"bits": bits_per_element(records, "grads"), "params": params, "hook": strategy.hook.__name__,
            "durations": [r.duration_s for r in records]}


@pytest.mark.timeout(TIMEOUT)
def test_half_compress_sends_16_bits_and_keeps_ranks_identical() -> None:
    a, b = run_ranks(2, _half, timeout=TIMEOUT)
    assert a["hook"] == "fp16_compress_hook"  # gloo: bf16 is refused off NCCL
    assert a["bits"] == b["bits"] == 16.0
    assert all(d > 0 for d in a["durations"])
    for pa, pb in zip(a["params"], b["params"], strict=True):
        assert torch.equal(pa, pb)


def test_half_hook_is_picked_by_backend() -> None:
    assert half_hook_for_backend("nccl").__name__ == "bf16_compress_hook"
    assert half_hook_for_backend("gloo").__name__ == "fp16_compress_hook"


def test_counting_stand_in_refuses_uncounted_collectives() -> None:
    proxy = _CountingDist()
    with pytest.raises(NotImplementedError, match="all_gather"):
        proxy.all_gather  # noqa: B018
    assert proxy.ReduceOp is dist.ReduceOp


def test_expected_elements_rule_matches_a_hand_count() -> None:
    # 16x8 and 4x16 weights compressed at rank 1 ((16+8) + (4+16)); the biases (16, 4) are not.
    assert _expected_powersgd_elements(tiny_mlp(), 1) == 24 + 20 + 16 + 4
    assert math.isclose(8 * 4 * 64 / 212, 9.66, rel_tol=1e-3)
