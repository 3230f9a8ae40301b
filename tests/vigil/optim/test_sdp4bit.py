"""SDP4Bit (vigil/optim/sdp4bit.py) and the topology it runs on (vigil/topology.py).

Multi-process tests run 4 gloo ranks on this machine through tests/vigil/optim/harness.py
(needs a free TCP port on 127.0.0.1; every run under a timeout), pretending to be 2 nodes of 2
ranks (``ranks_per_node=2``), or 2 nodes whose ranks interleave ({0, 3} and {1, 2}) to exercise the
shard reordering of the two-level all-to-all. The model is an 8,062-parameter MLP, one thread a rank.
One test runs the GPT example on the rank API (examples/gpt_pydoc) on the offline corpus, with a checkpoint and resume.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.vigil.optim.harness import run_ranks
from vigil import topology
from vigil.comm import Comm
from vigil.contract.schemas import OptimizerSpec
from vigil.optim import build_strategy
from vigil.optim.sdp4bit import VARIANTS, SDP4Bit, SDP4BitParams

WORLD = 4
TIMEOUT_S = 150.0
D_IN, D_HID = 64, 62
NUMEL = D_IN * D_HID + D_HID + D_HID * D_IN + D_IN  # 8062 -> padded to 4 shards of 2048
STEPS = 4
CLIP = 0.1  # below the mean gradient norm (~0.2) of these batches: clipping is active


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_IN))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, D_IN, generator=g)
    return x, torch.sin(x) + 0.1 * rank


def _spec(kind: str, **params: Any) -> OptimizerSpec:
    params.setdefault("ranks_per_node", 2)
    return OptimizerSpec(kind=kind, lr=3e-3, weight_decay=0.1, grad_clip=CLIP, params=params)


def _train(strategy: Any, rank: int, steps: range, check: Any = None) -> list[torch.Tensor]:
    """Run ``steps``; after each, this rank's full parameter vector (its replica).
    ``check(strategy, replica_before)`` runs after every step."""
    out = []
    for step in steps:
        strategy.comm.set_step(step)
        strategy.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(strategy.model(x), y).backward()
        before = strategy.flat.clone() if check is not None else None
        strategy.step(step, 3e-3)
        if check is not None:
            check(strategy, before)
        out.append(torch.cat([p.detach().reshape(-1) for p in strategy.model.parameters()]).clone())
    return out


def _qwd_error_ratio(ratios: list[float]) -> Any:
    """A check: the owner's replica shard is within one quantum of ``D = master - replica_before``
    of its master, i.e. only the last step's quantization error is in the replica (none accumulates)."""

    def check(strategy: SDP4Bit, before: torch.Tensor) -> None:
        master = strategy.master.detach()
        d = (master - before[strategy._shard]).view(-1, strategy.cfg.weight_group)
        quantum = (d.abs().amax(1, keepdim=True) / 7).expand_as(d).reshape(-1)
        err = (strategy.flat[strategy._shard] - master).abs()
        ratios.append(float((err / (quantum * (1 + 1e-3) + 1e-7)).max()))

    return check


def _roundtrip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


# --------------------------------------------------------------------------- rank functions


def _rank_variants(rank: int, world: int) -> dict[str, Any]:
    """Every variant (and the fp32 baseline) for STEPS steps from the same start."""
    out: dict[str, Any] = {}
    runs = {kind: _spec(kind) for kind in VARIANTS} | {"baseline": _spec("sdp4bit", weights="fp32", grads="fp32")}
    for name, spec in runs.items():
        comm = Comm.from_process_group()
        strategy = build_strategy(spec, _model(), comm)
        assert isinstance(strategy, SDP4Bit)
        ratios: list[float] = []
        check = _qwd_error_ratio(ratios) if strategy.cfg.weights == "qwd" else None
        params = _train(strategy, rank, range(STEPS), check)
        master_err = float((strategy.flat[strategy._shard] - strategy.master.detach()).norm()
                           / strategy.master.detach().norm())
        out[name] = {"params": params, "records": comm.drain(), "master_err": master_err, "qwd_ratio": ratios}
    # Plain DDP AdamW from the same start on the same batches.
    comm = Comm.from_process_group()
    ddp = build_strategy(OptimizerSpec(kind="adamw", lr=3e-3, weight_decay=0.1, grad_clip=CLIP), _model(), comm)
    out["ddp"] = {"params": _train(ddp, rank, range(STEPS))}
    return out


def _true_grads(rank: int) -> torch.Tensor:
    """A heavy-tailed gradient per rank (1% outliers x 50), as LLM gradients have."""
    g = torch.Generator().manual_seed(77 + rank)
    v = torch.randn(NUMEL, generator=g) * 1e-3
    mask = torch.rand(NUMEL, generator=g) < 0.01
    return torch.where(mask, v * 50, v)


def _reduce_errors(strategy: SDP4Bit, rank: int, world: int) -> float:
    offset = 0
    mine = _true_grads(rank)
    for p in strategy._params:
        p.grad = mine[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    shard = strategy._reduce_grads(strategy._gather_grads()).clone()
    exact = torch.zeros(strategy.padded)
    exact[:NUMEL] = sum(_true_grads(r) for r in range(world)) / world
    want = exact[strategy._shard]
    return float((shard - want).norm() / want.norm())


def _rank_reduce(rank: int, world: int, interleaved: bool) -> dict[str, float]:
    """Relative error of this rank's reduced gradient shard against the exact mean, per mode."""
    if interleaved:  # nodes {0, 3} and {1, 2}: the real discovery path with node ids that interleave
        topology.local_node_id = lambda: "A" if rank in (0, 3) else "B"
    out = {}
    for mode in ("fp32", "tlq", "tlq_hs", "ulq"):
        params: dict[str, Any] = {"weights": "fp32", "grads": mode}
        spec = OptimizerSpec(kind="sdp4bit", params=params) if interleaved else _spec("sdp4bit", **params)
        strategy = build_strategy(spec, _model(), Comm.from_process_group())
        assert isinstance(strategy, SDP4Bit)
        if interleaved:
            assert strategy.topo.intra_ranks == ((0, 3) if rank in (0, 3) else (1, 2))
        out[mode] = _reduce_errors(strategy, rank, world)
    return out


def _rank_resume(rank: int, world: int, kind: str) -> dict[str, Any]:
    spec = _spec(kind)
    full = _train(build_strategy(spec, _model(), Comm.from_process_group()), rank, range(6))
    first = build_strategy(spec, _model(), Comm.from_process_group())
    _train(first, rank, range(3))
    model_state = _roundtrip(first.model.state_dict())
    state = _roundtrip(first.state_dict())
    # A fresh process would build its model from another seed, then restore.
    second = build_strategy(spec, _model(seed=123), Comm.from_process_group())
    second.model.load_state_dict(model_state)
    second.load_state_dict(state)
    resumed = _train(second, rank, range(3, 6))
    # A state for another layout (here: another model size) is refused, the replica's weights kept.
    other = build_strategy(spec, nn.Linear(100, 100), Comm.from_process_group())
    try:
        other.load_state_dict(state)
        refused = False
    except ValueError:
        refused = torch.equal(other.master.detach(), other.flat[other._shard])
    return {"full": full, "resumed": resumed, "refused": refused}


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def variants() -> list[dict[str, Any]]:
    return run_ranks(WORLD, _rank_variants, timeout=TIMEOUT_S)


def test_replicas_bitwise_identical_after_every_step(variants: list[dict[str, Any]]) -> None:
    for name in [*VARIANTS, "baseline"]:
        for step in range(STEPS):
            ref = variants[0][name]["params"][step]
            for rank in range(1, WORLD):
                assert torch.equal(variants[rank][name]["params"][step], ref), (name, step, rank)
        # The weights really moved.
        assert not torch.equal(variants[0][name]["params"][-1], variants[0][name]["params"][0])


def test_every_variant_differs_from_the_baseline(variants: list[dict[str, Any]]) -> None:
    """Each ablation really quantizes something; all stay near the baseline after a few steps
    except qW, whose replica carries the full 4-bit error of the weights (the paper's worst)."""
    base = variants[0]["baseline"]["params"][-1]
    dev = {name: float((variants[0][name]["params"][-1] - base).norm() / base.norm()) for name in VARIANTS}
    assert all(d > 0 for d in dev.values()), dev
    assert max(dev, key=dev.__getitem__) == "sdp4bit_qw", dev
    assert all(d < 0.05 for name, d in dev.items() if name != "sdp4bit_qw"), dev
    assert dev["sdp4bit_qw"] < 0.3, dev


def _bits(records: list[Any]) -> dict[str, float]:
    out = {}
    for tag in {r.tag for r in records}:
        rs = [r for r in records if r.tag == tag]
        out[tag] = sum(8 * r.payload_bytes for r in rs) / sum(r.elements for r in rs)
    return out


def test_measured_bits_per_element(variants: list[dict[str, Any]]) -> None:
    w_bits = 4 + 32 / 2048
    expected = {
        "sdp4bit": {"grads_intra": 8.25, "grads_inter": 4.25, "weights": w_bits},
        "sdp4bit_qw": {"grads": 32.0, "weights": w_bits},
        "sdp4bit_qwd": {"grads": 32.0, "weights": w_bits},
        "sdp4bit_tlq": {"grads_intra": 8.25, "grads_inter": 4.25, "weights": 32.0},
        "sdp4bit_tlq_hs": {"grads_intra": 8.25, "grads_inter": 4.25, "weights": 32.0},
        "sdp4bit_ulq": {"grads_intra": 4.25, "grads_inter": 4.25, "weights": 32.0},
        "baseline": {"grads": 32.0, "weights": 32.0},
    }
    for rank in range(WORLD):
        for name, want in expected.items():
            records = variants[rank][name]["records"]
            got = _bits(records)
            for tag in ("init", "grad_norm"):
                got.pop(tag)
            assert got == pytest.approx(want, rel=1e-9), (name, rank, got)
            # One message per component per step, on the right group.
            for tag, group in (("grads_intra", "intra"), ("grads_inter", "inter"), ("weights", "world")):
                rs = [r for r in records if r.tag == tag]
                if tag in want:
                    assert len(rs) == STEPS and {r.group for r in rs} == {group}, (name, tag)
    # And per parameter per step: 8.25 + 4.25 / 2 (the inter hop carries half the buffer) + 4.016 / 4.
    recs = variants[0]["sdp4bit"]["records"]
    payload = sum(8 * r.payload_bytes for r in recs if r.tag in {"grads_intra", "grads_inter", "weights"})
    assert payload / (NUMEL * STEPS) == pytest.approx((8.25 + 4.25 / 2 + w_bits / 4) * 8192 / NUMEL)


def test_baseline_equals_ddp_adamw(variants: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        for step in range(STEPS):
            a = variants[rank]["baseline"]["params"][step]
            b = variants[rank]["ddp"]["params"][step][: a.numel()]
            assert torch.allclose(a, b, rtol=0, atol=2e-6), (rank, step, float((a - b).abs().max()))


def test_qwd_replica_tracks_master_qw_does_not(variants: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        qwd = variants[rank]["sdp4bit_qwd"]["master_err"]
        qw = variants[rank]["sdp4bit_qw"]["master_err"]
        assert qwd < qw / 5, (rank, qwd, qw)
        assert variants[rank]["baseline"]["master_err"] == 0.0
        for name in ("sdp4bit", "sdp4bit_qwd"):
            ratios = variants[rank][name]["qwd_ratio"]
            assert len(ratios) == STEPS and max(ratios) <= 1.0, (name, rank, ratios)


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_two_level_reduce_gives_the_mean_gradient_shard(interleaved: bool) -> None:
    results = run_ranks(WORLD, _rank_reduce, interleaved, timeout=TIMEOUT_S)
    for rank, err in enumerate(results):
        assert err["fp32"] < 1e-6, (rank, err)
        # The right shard, with quantization error only: a misrouted shard would be off by ~140%
        # (two unrelated vectors). The outliers make plain 4-bit groups coarse (TLq ~0.4).
        assert err["tlq"] < 0.6 and err["tlq_hs"] < 0.3, (rank, err)
        assert err["tlq_hs"] < err["tlq"] < err["ulq"], (rank, err)


@pytest.mark.parametrize("kind", ["sdp4bit", "sdp4bit_qw"])
def test_save_restore_matches_uninterrupted_run(kind: str) -> None:
    for rank, res in enumerate(run_ranks(WORLD, _rank_resume, kind, timeout=TIMEOUT_S)):
        for a, b in zip(res["full"][3:], res["resumed"], strict=True):
            assert torch.equal(a, b), rank
        assert res["refused"], rank


def _rank_loop(rank: int, world: int, kind: str, out: str, cache: str) -> dict[str, Any]:
    """The GPT example on the rank API with SDP4Bit: a full run checkpointing at step 6,
    then a run resumed from that checkpoint."""
    from examples.gpt_pydoc.gpt_train import train
    from vigil.contract.schemas import JobCreate
    from vigil.sdk import RankContext

    spec = JobCreate(
        name="sdp4bit-loop", model={"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
        data={"max_bytes": 200_000, "seed": 5},
        optimizer={"kind": kind, "lr": 3e-3, "params": {"ranks_per_node": 2}},
        lr_schedule={"kind": "cosine", "warmup_steps": 2}, steps=12, batch_size=8, eval_interval=12,
        checkpoint={"interval_steps": 6},
    )
    ckpt_dir = Path(out) / f"{kind}-ckpt"

    def report(metrics: dict[str, Any], ckpt: Path | None) -> None:
        if ckpt is not None and metrics["step"] == 6:  # the loop deletes ckpt after report: keep a copy
            ckpt_dir.mkdir(exist_ok=True)
            for f in ckpt.iterdir():
                shutil.copy2(f, ckpt_dir / f.name)

    full = train(spec, RankContext(rank=rank, world_size=world, job_id="sdp4bit-loop", report=report,
                                   cache_dir=Path(cache)))
    resumed = train(spec, RankContext(rank=rank, world_size=world, job_id="sdp4bit-loop", cache_dir=Path(cache),
                                      restore_dir=ckpt_dir))
    assert full.model is not None and resumed.model is not None
    return {
        "losses": full.losses,
        "full": torch.cat([p.detach().reshape(-1) for p in full.model.parameters()]),
        "resumed": torch.cat([p.detach().reshape(-1) for p in resumed.model.parameters()]),
    }


def test_train_loop_with_sdp4bit(tmp_path: Path, corpus_cache: Path) -> None:
    """Through the real loop and its checkpoints: loss falls, replicas agree, resume is exact."""
    res = run_ranks(WORLD, _rank_loop, "sdp4bit", str(tmp_path), str(corpus_cache), timeout=TIMEOUT_S)
    for r in res:
        assert torch.equal(r["full"], res[0]["full"])
        assert torch.equal(r["resumed"], r["full"])
    losses = res[0]["losses"]
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < first - 0.5, (first, last)


# --------------------------------------------------------------------------- single process


def test_single_rank_runs_without_a_process_group() -> None:
    strategy = build_strategy(OptimizerSpec(kind="sdp4bit"), _model(), Comm())
    before = torch.cat([p.detach().reshape(-1).clone() for p in strategy.model.parameters()])
    _train(strategy, 0, range(2))
    after = torch.cat([p.detach().reshape(-1) for p in strategy.model.parameters()])
    assert not torch.equal(before, after)


def test_config_validation() -> None:
    cfg = OptimizerSpec(kind="sdp4bit_ulq", params={"seed": 3}).typed_params(SDP4BitParams)
    assert (cfg.weights, cfg.grads, cfg.seed, cfg.weight_group, cfg.grad_group) == ("fp32", "ulq", 3, 2048, 128)
    refused = (({"bogus": 1}, "bogus"), ({"grads": "tlq_x"}, "grads"), ({"hadamard_order": 24}, "hadamard_order"),
               ({"grad_group": 48}, "hadamard_order"), ({"weight_group": 2.5}, "weight_group"),
               ({"ranks_per_node": 0}, "ranks_per_node"))
    for params, field in refused:
        with pytest.raises(ValueError, match=rf"optimizer\.params\.{field} \(sdp4bit\): "):
            OptimizerSpec(kind="sdp4bit", params=params)


def test_layout_of_interleaved_nodes() -> None:
    ids = ["A", "B", "B", "A", "C", "C"]
    t = topology.layout(ids, 3)
    assert t.node_ranks == ((0, 3), (1, 2), (4, 5))
    assert (t.node_index, t.local_rank, t.intra_ranks, t.inter_ranks) == (0, 1, (0, 3), (2, 3, 5))
    assert t.inter_ranks_of(1) == (0, 1, 4)
    with pytest.raises(ValueError):
        topology.layout(["A", "A", "B"], 0)
