"""The public rank API (vigil.sdk) with a user's own model, data and loop (not the bundled GPT).

Single-process tests (a world of one, no process group) for the step, phase, report, fault and
checkpoint rules; one 2-rank gloo run (``run_ranks``: 127.0.0.1, free port, under a timeout) drives
every optimizer of the registry through :func:`vigil.sdk.optimizer` on a small MLP.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.vigil.optim.harness import run_ranks
from tests.vigil.telemetry_sink import Sink
from vigil import sdk as vigil
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import fault_file_path
from vigil.faults import NAN_LOSS, SLOW_RANK
from vigil.optim import REGISTRY

ROOT = Path(__file__).resolve().parents[2]


class Position:
    def __init__(self) -> None:
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = int(state["i"])


def _spec(**kw: Any) -> JobCreate:
    return JobCreate.model_validate({"name": "sdk", "steps": 6, "checkpoint": {"interval_steps": 3}, **kw})


def _user_loop(steps: int, *, phases: bool = True, work_s: float = 0.0) -> dict[str, Any]:
    """A user's loop: a regression MLP on generated data, as the README shows it. ``work_s``: that much more
    compute per step (a sleep in the forward), so that a compute phase outweighs a busy host's jitter."""
    run = vigil.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = vigil.optimizer(model)
    pos = Position()
    start = (vigil.restore(model=model, optimizer=opt, data=pos) or 0) + 1
    g = torch.Generator().manual_seed(run.rank)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    for step in range(start, steps + 1):
        with vigil.step(step) as s:
            if phases:
                with s.phase("data"):
                    xb, yb = x[pos.i % 8 * 8 :][:8], y[pos.i % 8 * 8 :][:8]
                    pos.i += 1
                with s.phase("forward_backward"):
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(opt.model(xb), yb)
                    loss.backward()
            else:
                xb, yb = x[:8], y[:8]
                opt.zero_grad()
                time.sleep(work_s)
                loss = nn.functional.mse_loss(opt.model(xb), yb)
                loss.backward()
            opt.step()
            vigil.report(loss, tokens=8, mine=1.5)
        vigil.checkpoint(step, model=model, optimizer=opt, data=pos)
    return {"model": model, "start": start}


def test_a_user_loop_sends_step_samples_with_its_phases_and_collectives(tmp_path: Path) -> None:
    sink = Sink()
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-sdk", telemetry=sink, checkpoint_root=tmp_path / "c")
    summary = vigil.run(lambda cfg: _user_loop(6), ctx, _spec())
    assert [s.step for s in sink.steps] == [1, 2, 3, 4, 5, 6]
    for s, recs in zip(sink.steps, sink.records, strict=True):
        assert (s.job_id, s.rank, s.tokens) == ("job-sdk", 0, 8) and s.loss is not None
        assert s.data_s is not None and s.fwd_bwd_s is not None and s.optim_s is not None and s.comm_s is not None
        assert s.data_s + s.fwd_bwd_s + s.optim_s + s.comm_s <= s.step_time_s + 1e-6
        # DDP AdamW's gradient all-reduce of this step, through the communication layer.
        assert ("all_reduce", "grads") in {(r.op, r.tag) for r in recs if r.step == s.step}
        assert s.cpu_wait_s is not None and 0.0 <= s.cpu_wait_s <= s.step_time_s + 0.01
    assert summary.checkpoints == [3, 6] and summary.final_step == 6
    assert [(c.step, c.valid) for c in sink.checkpoints] == [(3, True), (6, True)]


def _spin_loop(steps: int, spin_s: float) -> None:
    vigil.init()
    for step in range(1, steps + 1):
        with vigil.step(step):
            end = time.process_time() + spin_s  # CPU time, however long the wall clock takes to give it
            while time.process_time() < end:
                pass


def test_a_step_reports_the_time_it_waited_for_a_cpu_another_process_held() -> None:
    # The rank and a process burning CPU share one core: the kernel runs each about half the time, and the
    # rank's step reports the other half as run-queue wait (what tells a host's load from a slow rank).
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    burner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # the burner runs, pinned
        os.sched_setaffinity(0, {cpu})
        sink = Sink()
        vigil.run(lambda cfg: _spin_loop(3, 0.1), vigil.RankContext(rank=0, world_size=1, job_id="job-cpu",
                                                                    telemetry=sink), _spec(checkpoint={"interval_steps": 0}))
    finally:
        os.sched_setaffinity(0, before)
        burner.kill()
        burner.wait()
    for s in sink.steps:
        assert s.cpu_wait_s is not None and s.cpu_wait_s > 0.3 * s.step_time_s, (s.cpu_wait_s, s.step_time_s)


def test_unmarked_phases_are_inferred_and_the_rest_is_compute() -> None:
    sink = Sink()
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-sdk", telemetry=sink)
    vigil.run(lambda cfg: _user_loop(3, phases=False), ctx, _spec(checkpoint={"interval_steps": 0}))
    for s in sink.steps:
        assert s.data_s is None and s.optim_s is not None
        assert s.fwd_bwd_s == pytest.approx(s.step_time_s - s.optim_s - s.comm_s - 0.0, abs=s.step_time_s * 0.5)
        assert s.fwd_bwd_s > 0


def test_restore_resumes_bitwise_where_the_checkpoint_left_off(tmp_path: Path) -> None:
    root = tmp_path / "c"
    full: dict[str, Any] = {}
    vigil.run(lambda cfg: full.update(_user_loop(6)), vigil.RankContext(rank=0, world_size=1, job_id="j",
                                                                         checkpoint_root=root, async_checkpoints=False),
              _spec())
    # Remove the last checkpoint: a restart resumes after step 3 and must end where the full run did.
    import shutil

    shutil.rmtree(root / "step-00000006")
    again: dict[str, Any] = {}
    vigil.run(lambda cfg: again.update(_user_loop(6)), vigil.RankContext(rank=0, world_size=1, job_id="j",
                                                                          checkpoint_root=root), _spec())
    assert again["start"] == 4
    for a, b in zip(full["model"].parameters(), again["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_nan_fault_poisons_a_user_model_for_real_and_is_never_checkpointed(tmp_path: Path) -> None:
    fault = fault_file_path(tmp_path / "run", "job-nan", 0)
    fault.parent.mkdir(parents=True)
    fault.write_text(f'{{"kind": "{NAN_LOSS}", "step": 2, "fault_id": 1}}')
    sink = Sink()
    out: dict[str, Any] = {}
    summary = vigil.run(lambda cfg: out.update(_user_loop(6)), vigil.RankContext(
        rank=0, world_size=1, job_id="job-nan", telemetry=sink, fault_file=fault, checkpoint_root=tmp_path / "c"),
        _spec())
    assert summary.faults == [2]
    assert [s.loss is None for s in sink.steps] == [False, True, True, True, True, True]
    assert not all(bool(p.isfinite().all()) for p in out["model"].parameters())
    assert summary.checkpoints == [] and summary.skipped_checkpoints == [3, 6]


def _slowed_loop(tmp_path: Path, job: str, fault_body: str, steps: int = 6) -> tuple[Sink, Any]:
    """An unmarked loop with 10 ms of work per step run under a fault file holding ``fault_body``: (its
    telemetry, its summary). The MLP's own compute is well under a millisecond, which a busy host's scheduling
    can stretch more than a fault does (seen under -n 2: a slowed step 3x its neighbour); 10 ms cannot be."""
    fault = fault_file_path(tmp_path / "run", job, 0)
    fault.parent.mkdir(parents=True)
    fault.write_text(fault_body)
    sink = Sink()
    summary = vigil.run(lambda cfg: _user_loop(steps, phases=False, work_s=0.01), vigil.RankContext(
        rank=0, world_size=1, job_id=job, telemetry=sink, fault_file=fault), _spec(checkpoint={"interval_steps": 0}))
    return sink, summary


def test_slow_fault_stretches_the_compute_of_an_unmarked_loop(tmp_path: Path) -> None:
    sink, _ = _slowed_loop(tmp_path, "job-slow", f'{{"kind": "{SLOW_RANK}", "step": 4, "factor": 20.0}}')
    before = min(s.fwd_bwd_s or 0 for s in sink.steps[1:3])
    during = min(s.fwd_bwd_s or 0 for s in sink.steps[3:])
    assert during > 5 * before  # 20x asked; a busy host only adds


def test_a_comm_slow_fault_makes_the_rank_late_to_its_collectives_not_slow_to_compute(tmp_path: Path) -> None:
    sink, _ = _slowed_loop(tmp_path, "job-comm", f'{{"kind": "{SLOW_RANK}", "step": 4, "factor": 20.0, "mode": "comm"}}')
    before, during = sink.steps[1:3], sink.steps[3:]
    # The same ~19 x 10 ms as the compute mode, spent in the optimizer phase before its collectives: forward+
    # backward keeps its pace, the collectives' own timing does not include the wait.
    assert min(s.optim_s for s in during) > 0.15 > 5 * max(s.optim_s for s in before)
    assert max(s.fwd_bwd_s for s in during) < 0.1 and max(s.comm_s for s in during) < 0.1
    assert min(s.step_time_s for s in during) > 0.19


def test_a_fault_file_with_an_unknown_slow_mode_is_ignored(tmp_path: Path) -> None:
    sink, summary = _slowed_loop(tmp_path, "job-bad", f'{{"kind": "{SLOW_RANK}", "step": 2, "factor": 20.0, '
                                 '"mode": "sideways"}', steps=4)
    assert summary.faults == [] and max(s.step_time_s for s in sink.steps[1:]) < 0.15


def test_misuse_is_refused_with_the_rule() -> None:
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="j")

    def bad(cfg: dict[str, Any]) -> None:
        model = nn.Linear(2, 1)
        opt = vigil.optimizer(model)
        with pytest.raises(RuntimeError, match="needs an open step"):
            vigil.report(1.0)
        with pytest.raises(RuntimeError, match="needs an open step"):
            opt.step()
        with vigil.step(1) as s:
            with pytest.raises(ValueError, match="phase"), s.phase("thinking"):
                pass
            with pytest.raises(RuntimeError, match="still open"), vigil.step(2):
                pass
            with pytest.raises(RuntimeError, match="inside a step"):
                vigil.checkpoint(1, model=model)
            with pytest.raises(ValueError, match="metric 'note' must be a number"):
                s.report(note="hello")
        with pytest.raises(ValueError, match="step must be >= 1"):
            vigil.step(0)
        with pytest.raises(TypeError, match="nn.Module"):
            vigil.optimizer("not a model")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tau"):
            vigil.optimizer(nn.Linear(2, 1), "dsm", params={"tau": 0})
        with pytest.raises(ValueError, match="kind"):
            vigil.optimizer(nn.Linear(2, 1), "sgd-of-my-own")

    vigil.run(bad, ctx, _spec())
    with pytest.raises(RuntimeError, match="no Vigil session"):
        vigil.get_session()


def test_a_function_gets_the_job_config() -> None:
    seen: list[dict[str, Any]] = []
    vigil.run(seen.append, vigil.RankContext(rank=0, world_size=1, job_id="j"), _spec(config={"epochs": 3}))
    assert seen == [{"epochs": 3}]


def test_a_script_runs_standalone_outside_vigil() -> None:
    out = subprocess.run([sys.executable, "examples/script_regression/train.py", "--epochs", "1",
                          "--batches-per-epoch", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------------------------------------
# Every optimizer of the registry through the public API, on a user's model, 2 ranks
# --------------------------------------------------------------------------------------------------

PARAMS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_iter": 2}, "local_adamw": {"tau": 2}, "slowmo": {"tau": 2}, "dsm": {"tau": 2},
    "cser": {"rc1": 8, "rc2": 2, "H": 2}, "cser_pl": {"H": 2}, "qsparse_local_sgd": {"H": 2},
    "compressed_adam": {"compressor": "onebit"},
}


def _every_kind(rank: int, world: int, steps: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in sorted(REGISTRY):
        sink = Sink()
        ctx = vigil.RankContext(rank=rank, world_size=world, job_id=f"job-{kind.replace('_', '-')}", telemetry=sink)
        spec = JobCreate.model_validate({"name": kind, "steps": steps, "optimizer": {
            "kind": kind, "lr": 1e-2, "params": PARAMS.get(kind, {})}})
        final: list[torch.Tensor] = []

        def loop(cfg: dict[str, Any], final: list[torch.Tensor] = final) -> None:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
            opt = vigil.optimizer(model)
            g = torch.Generator().manual_seed(100 + rank)
            for step in range(1, steps + 1):
                with vigil.step(step) as s:
                    x = torch.randn(16, 16, generator=g)
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(opt.model(x), (x[:, 0] > 0).long())
                    loss.backward()
                    opt.step()
                    s.report(loss)
            final.extend(p.detach().clone() for p in opt.eval_module().parameters())

        vigil.run(loop, ctx, spec)
        results[kind] = {
            "losses": [s.loss for s in sink.steps],
            "ops": sorted({(r.op, r.tag) for recs in sink.records for r in recs}),
            "wire": sum(r.wire_bytes for recs in sink.records for r in recs),
            "eval": final,
        }
    return results


@pytest.mark.timeout(300)
def test_every_optimizer_of_the_registry_runs_on_a_user_model_through_the_api() -> None:
    steps = 4
    per_rank = run_ranks(2, _every_kind, steps, timeout=280)
    assert set(per_rank[0]) == set(REGISTRY)
    for kind in REGISTRY:
        a, b = per_rank[0][kind], per_rank[1][kind]
        for r in (a, b):
            assert len(r["losses"]) == steps and all(x is not None and math.isfinite(x) for x in r["losses"]), kind
            assert r["ops"] and r["wire"] > 0, f"{kind}: no collective went through the communication layer"
        # The synchronised model a strategy evaluates is the same on both ranks.
        for p, q in zip(a["eval"], b["eval"], strict=True):
            assert torch.allclose(p, q, atol=1e-6), kind
