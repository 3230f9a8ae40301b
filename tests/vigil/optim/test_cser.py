"""CSER, EF-SGD and QSparse-local-SGD with the GRBS compressor (ALGORITHMS.md §3).

Needs torch with gloo; multi-rank tests run 2-4 processes through ``harness.run_ranks`` (127.0.0.1,
free port, under a timeout). The references (synchronous SGD, local SGD) are written here with
``torch.optim.SGD`` and plain ``torch.distributed`` calls, independent of the code under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.vigil.optim.common import (
    batch,
    flat_params,
    make,
    payload_bits_per_param_step,
    tiny_mlp,
    train_step,
)
from tests.vigil.optim.harness import run_ranks
from vigil.optim.cser import GRBS

TIMEOUT = 120
LR, WD, MU = 0.05, 0.01, 0.9


def _sgd_reference(rank: int, world: int, steps: int, period: int | None) -> list[torch.Tensor]:
    """Synchronous SGD (period None: gradients averaged every step) or local SGD (models averaged every period)."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MU, nesterov=True, weight_decay=WD)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        F.mse_loss(model(x), y).backward()
        if period is None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        if period is not None and (step + 1) % period == 0:
            with torch.no_grad():
                for p in model.parameters():
                    dist.all_reduce(p)
                    p.div_(world)
        out.append(flat_params(model))
    return out


def _trajectory(rank: int, kind: str, steps: int, **params: object) -> list[torch.Tensor]:
    strategy = make(kind, tiny_mlp(), lr=LR, weight_decay=WD, momentum=MU, **params)
    out = []
    for step in range(steps):
        train_step(strategy, rank, step, lr=LR)
        out.append(flat_params(strategy.module))
    return out


def _reductions(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    steps, period = 6, 3
    return {
        "sync": _sgd_reference(rank, world, steps, None),
        "local": _sgd_reference(rank, world, steps, period),
        "cser_c1_identity": _trajectory(rank, "cser", steps, rc1=1, rc2=1, H=2),
        "ef_identity": _trajectory(rank, "ef_sgd", steps, ratio=1),
        "cser_c1_zero_c2_identity": _trajectory(rank, "cser", steps, rc1=0, rc2=1, H=period),
        "qsparse_identity": _trajectory(rank, "qsparse_local_sgd", steps, ratio=1, H=period),
        "cser_c1_zero_c2_grbs": _trajectory(rank, "cser", steps, rc1=0, rc2=2, H=period),
        "cser_pl": _trajectory(rank, "cser_pl", steps, rc2=2, H=period),
        "cser": _trajectory(rank, "cser", steps, rc1=4, rc2=2, H=period),
    }


@pytest.mark.timeout(TIMEOUT)
def test_reductions_to_sync_sgd_local_sgd_and_cser_pl() -> None:
    results = run_ranks(4, _reductions, timeout=TIMEOUT)
    close = {"rtol": 1e-5, "atol": 1e-6}
    for res in results:
        for step, ref in enumerate(res["sync"]):
            assert torch.allclose(res["cser_c1_identity"][step], ref, **close), step  # C1 = I: synchronous SGD
            assert torch.allclose(res["ef_identity"][step], ref, **close), step
        for step, ref in enumerate(res["local"]):
            assert torch.allclose(res["cser_c1_zero_c2_identity"][step], ref, **close), step  # local SGD, period H
            assert torch.allclose(res["qsparse_identity"][step], ref, **close), step
            assert torch.equal(res["cser_c1_zero_c2_grbs"][step], res["cser_pl"][step]), step  # C1 = 0: CSER-PL
        # Not vacuous: the references differ from each other and from CSER with real compression.
        assert not torch.allclose(res["sync"][-1], res["local"][-1], **close)
        assert not torch.allclose(res["cser"][-1], res["sync"][-1], **close)
        assert not torch.allclose(res["cser_pl"][-1], res["local"][-1], **close)


def _invariant(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    strategy = make("cser", tiny_mlp(), lr=LR, weight_decay=WD, grad_clip=1.0, rc1=4, rc2=2, H=3)
    out = []
    for step in range(7):
        train_step(strategy, rank, step, lr=LR)
        out.append({"x": strategy.flat.data.clone(), "e": strategy.error.clone(), "x_hat": strategy.x_hat.clone()})
    return out


@pytest.mark.timeout(TIMEOUT)
def test_cser_x_minus_e_is_identical_on_all_ranks_after_every_step() -> None:
    per_rank = run_ranks(4, _invariant, timeout=TIMEOUT)
    for step in range(7):
        first = per_rank[0][step]
        for other in per_rank[1:]:
            s = other[step]
            assert torch.equal(s["x_hat"], first["x_hat"]), step
            diff = (s["x"] - s["e"]) - (first["x"] - first["e"])
            assert diff.abs().max() <= 1e-6, (step, diff.abs().max())
        assert torch.allclose(first["x"] - first["e"], first["x_hat"], rtol=0, atol=1e-6)
        # The models themselves differ (a non-trivial error) except right after a full reset.
        assert not torch.equal(per_rank[0][step]["x"], per_rank[1][step]["x"])
        assert first["e"].abs().max() > 0


def _bits(rank: int, world: int, kind: str, steps: int, params: dict) -> float:
    model = tiny_mlp()
    n = sum(p.numel() for p in model.parameters())
    strategy = make(kind, model, lr=LR, **params)
    strategy.comm.drain()
    records = []
    for step in range(steps):
        train_step(strategy, rank, step, lr=LR)
        records.extend(strategy.comm.drain())
    return payload_bits_per_param_step(records, n, steps)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(
    ("kind", "params", "expected"),
    [
        # 32 (1/R_C1 + 1/(H R_C2)); H = R_C1/R_C2 -> overall R = R_C1/2 (here 2: 16 b/p/step)
        ("cser", {"rc1": 4, "rc2": 2, "H": 2}, 32 * (1 / 4 + 1 / (2 * 2))),
        ("cser_pl", {"rc2": 2, "H": 2}, 32 / (2 * 2)),
        ("ef_sgd", {"ratio": 4}, 32 / 4),
        ("qsparse_local_sgd", {"ratio": 2, "H": 2}, 32 / (2 * 2)),
    ],
)
def test_measured_payload_matches_the_formula(kind: str, params: dict, expected: float) -> None:
    for bpps in run_ranks(2, _bits, kind, 4, params, timeout=TIMEOUT):
        assert bpps == pytest.approx(expected, rel=1e-12)


def test_grbs_blocks_are_contiguous_per_tensor_and_shared_by_seed() -> None:
    sizes = [128, 16, 64, 4]
    a, b = GRBS(sizes, 4, seed=7), GRBS(sizes, 4, seed=7)
    offsets = [0, 128, 144, 208]
    seen = set()
    for _ in range(20):
        ia, ib = a.indices(), b.indices()
        assert ia is not None and ib is not None and torch.equal(ia, ib)
        assert ia.numel() == 32 + 4 + 16 + 1
        start = 0
        for off, n, blk in zip(offsets, sizes, [32, 4, 16, 1], strict=True):
            block = ia[start : start + blk]
            assert torch.equal(block, torch.arange(int(block[0]), int(block[0]) + blk))
            assert off <= int(block[0]) and int(block[-1]) < off + n
            start += blk
        seen.add(tuple(ia.tolist()))
    assert len(seen) > 10  # positions change from call to call
    assert GRBS(sizes, 1, seed=0).indices() is None
    assert GRBS(sizes, 0, seed=0).is_zero
    with pytest.raises(ValueError):
        GRBS(sizes, 0.5, seed=0)


def test_cser_pl_rejects_a_c1_ratio() -> None:
    with pytest.raises(ValueError, match="rc1"):
        make("cser_pl", tiny_mlp(), rc1=4)
