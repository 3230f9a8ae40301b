"""Local AdamW, SlowMo and DSM-LS (ALGORITHMS.md §1 and baselines).

Needs torch with gloo; the multi-rank tests start 2-4 processes on 127.0.0.1 through
``harness.run_ranks`` (free port by binding port 0, everything under a timeout). The exact
reductions are checked bit for bit (``torch.equal``), the update rule against the formula in float64,
and the measured payload of the communication layer against 32/tau b/p/step.
"""

from __future__ import annotations

import pytest
import torch

from tests.vigil.optim.common import (
    bits_per_element,
    flat_params,
    make,
    payload_bits_per_param_step,
    tiny_mlp,
    train_step,
)
from tests.vigil.optim.harness import run_ranks
from vigil.comm import Comm
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.dsm import DSMLS
from vigil.optim.local import SlowMo

TIMEOUT = 120


def _identity(c: torch.Tensor) -> torch.Tensor:
    return c.clone()


def _dsm_vs_local(rank: int, world: int, sharded: bool, tau: int, steps: int) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {"local": [], "dsm_identity": [], "dsm_sign": [], "slowmo": []}
    for name, trajectory in out.items():
        model = tiny_mlp()
        comm = Comm.from_process_group()
        if name == "local":
            strategy = make("local_adamw", model, comm, tau=tau, sharded=sharded)
        elif name == "slowmo":
            strategy = make("slowmo", model, comm, tau=tau, sharded=sharded, alpha=1.0, beta=0.0)
        else:
            spec = OptimizerSpec(
                kind="dsm", lr=1e-2, weight_decay=0.0, grad_clip=0.0,
                params={"tau": tau, "sharded": sharded, "beta1": 0.0, "beta2": 0.0, "gamma": 1.0, "global_wd": 0.0},
            )
            strategy = DSMLS(model, comm, spec, sign_fn=_identity if name == "dsm_identity" else None)
        for step in range(steps):
            # A learning rate that changes every step: d divides by the current one.
            train_step(strategy, rank, step, lr=1e-2 * (1 + 0.1 * step))
            trajectory.append(flat_params(strategy.model))
    return out


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("sharded", [True, False])
def test_dsm_with_identity_sign_is_local_adamw_bit_for_bit(sharded: bool) -> None:
    tau, steps = 3, 8
    results = run_ranks(4, _dsm_vs_local, sharded, tau, steps, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        for step in range(steps):
            assert torch.equal(res["dsm_identity"][step], res["local"][step]), (rank, step)
            assert torch.equal(res["slowmo"][step], res["local"][step]), (rank, step)
        # The real sign step is a different method: the comparison can fail.
        assert not torch.equal(res["dsm_sign"][tau - 1], res["local"][tau - 1])
        # Before the first sync nothing but local AdamW has happened.
        assert torch.equal(res["dsm_sign"][tau - 2], res["local"][tau - 2])


def _sync_identity(rank: int, world: int, kind: str, tau: int, steps: int, params: dict) -> list[torch.Tensor]:
    model = tiny_mlp()
    strategy = make(kind, model, tau=tau, weight_decay=0.1, grad_clip=1.0, **params)
    out = []
    for step in range(steps):
        train_step(strategy, rank, step)
        out.append(flat_params(strategy.model))
    return out


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("local_adamw", {}),
        ("slowmo", {}),
        ("dsm", {}),
        ("dsm", {"sharded": False}),
        ("dsm", {"sign": "randomized"}),
    ],
)
def test_identical_parameters_after_every_sync(kind: str, params: dict) -> None:
    tau, steps = 3, 7
    per_rank = run_ranks(4, _sync_identity, kind, tau, steps, params, timeout=TIMEOUT)
    for step in range(steps):
        same = all(torch.equal(per_rank[0][step], r[step]) for r in per_rank[1:])
        if (step + 1) % tau == 0:
            assert same, f"ranks differ after the sync of step {step}"
        else:
            assert not same, f"ranks agree at step {step} without a sync: the test data cannot tell"


def _measure(rank: int, world: int, kind: str, params: dict, steps: int) -> dict:
    model = tiny_mlp()
    n = sum(p.numel() for p in model.parameters())
    strategy = make(kind, model, **params)
    strategy.comm.drain()  # the initial broadcast is not a training step's traffic
    records = []
    for step in range(steps):
        train_step(strategy, rank, step)
        records.extend(strategy.comm.drain())
    return {
        "bpps": payload_bits_per_param_step(records, n, steps),
        "sync_bits": bits_per_element(records, "sync"),
        "wire_per_step": sum(r.wire_bytes for r in records) / steps,
        "n": n,
    }


@pytest.mark.timeout(TIMEOUT)
def test_measured_payload_matches_32_over_tau() -> None:
    world, steps = 4, 24
    replicated = run_ranks(world, _measure, "dsm", {"tau": 12, "sharded": False}, steps, timeout=TIMEOUT)
    sharded = run_ranks(world, _measure, "dsm", {"tau": 12}, steps, timeout=TIMEOUT)
    local = run_ranks(world, _measure, "local_adamw", {"tau": 12}, steps, timeout=TIMEOUT)
    for r in replicated + local:
        assert r["bpps"] == pytest.approx(32 / 12, rel=1e-12)  # 2.67 b/p/step, 12x less than DDP
        assert r["sync_bits"] == 32.0
    for r, rep in zip(sharded, replicated, strict=True):
        # Reduce-scatter (32 b/p) + all-gather of the owner's shard (32/N b/p) ...
        assert r["bpps"] == pytest.approx(32 / 12 * (1 + 1 / world), rel=1e-12)
        assert r["sync_bits"] == 32.0
        # ... is the same ring traffic as one all-reduce.
        assert r["wire_per_step"] == rep["wire_per_step"]


def test_dsm_global_step_matches_the_formula() -> None:
    """One process: the sync reduces to the global step on this rank's model; compare in float64."""
    tau, lr, wd, gamma, b1, b2 = 2, 0.05, 0.1, 0.7, 0.9, 0.8
    model = tiny_mlp()
    spec = OptimizerSpec(kind="dsm", lr=lr, weight_decay=0.0, grad_clip=0.0,
                         params={"tau": tau, "gamma": gamma, "beta1": b1, "beta2": b2, "global_wd": wd})
    strategy = DSMLS(model, Comm(), spec)
    x_old = flat_params(model).double()
    m = torch.zeros_like(x_old)
    seen: list[torch.Tensor] = []
    outer = strategy.outer

    def spy(x_avg: torch.Tensor, lr_t: float) -> torch.Tensor:
        seen.append(x_avg.detach().double().clone())
        return outer(x_avg, lr_t)

    strategy.outer = spy  # type: ignore[method-assign]
    for sync in range(3):
        for k in range(tau):
            train_step(strategy, 0, sync * tau + k, lr=lr)
        assert len(seen) == sync + 1
        x_avg = seen[-1]
        d = (x_old - x_avg) / lr
        c = b1 * m + (1 - b1) * d
        x_old = x_old * (1 - gamma * lr * wd) - gamma * lr * torch.sign(c)
        m = b2 * m + (1 - b2) * d
        got = flat_params(model).double()
        assert torch.allclose(got, x_old, atol=1e-6, rtol=0), (sync, (got - x_old).abs().max())
        assert torch.allclose(strategy.m.double()[: m.numel()], m, atol=1e-4, rtol=1e-5)


def test_randomized_sign_is_unbiased_up_to_the_radius() -> None:
    strategy = DSMLS(tiny_mlp(), Comm(), OptimizerSpec(kind="dsm", params={"sign": "randomized"}))
    c = torch.linspace(-2.0, 1.0, 7)
    draws = torch.stack([strategy.sign_fn(c) for _ in range(1500)])
    assert set(draws.unique().tolist()) <= {-1.0, 1.0}
    assert torch.allclose(draws.mean(0), c / 2.0, atol=0.08)


def test_slowmo_bad_params_are_value_errors() -> None:
    with pytest.raises(ValueError, match="beta"):
        SlowMo(tiny_mlp(), Comm(), OptimizerSpec(kind="slowmo", params={"beta": 1.5}))
    with pytest.raises(ValueError, match="unknown"):
        SlowMo(tiny_mlp(), Comm(), OptimizerSpec(kind="slowmo", params={"gamma": 1.0}))
    with pytest.raises(ValueError, match="tau"):
        SlowMo(tiny_mlp(), Comm(), OptimizerSpec(kind="slowmo", params={"tau": "twelve"}))
