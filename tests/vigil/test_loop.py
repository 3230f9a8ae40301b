"""The bundled GPT example's loop on the rank API (vigil.sdk), without Ray: 2 ranks as torch.multiprocessing processes over gloo on 127.0.0.1.

Needs torch with gloo (CPU) and a free TCP port on localhost (found by binding port 0); every
process runs under a timeout and is killed if it overruns. Also single-process tests of the lr
schedule and of restoring a 2-rank checkpoint on 1 rank (an elastic restart).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import shutil
from collections.abc import Sequence
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt_pydoc.gpt_train import lr_at, train
from vigil.checkpointing import MANIFEST_FILE, verify
from vigil.comm import CollectiveRecord
from vigil.contract.probe import free_port
from vigil.contract.schemas import CheckpointSample, JobCreate, StepSample
from vigil.runner import ray_node_name
from vigil.sdk import MAX_PREEMPTION_CHECK_STEPS, PreemptionSchedule, RankContext

STEPS = 20
SPEC = JobCreate(
    name="loop-test",
    model={"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
    data={"max_bytes": 200_000, "seed": 5},
    optimizer={"kind": "adamw", "lr": 3e-3},
    lr_schedule={"kind": "cosine", "warmup_steps": 2},
    steps=STEPS,
    batch_size=8,
    eval_interval=10,
    checkpoint={"interval_steps": 10},
)
TIMEOUT_S = 150


class RecordingSink:
    """Telemetry sink that keeps what the loop sends (the transport is tested in test_telemetry)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.collectives: list[list[CollectiveRecord]] = []
        self.checkpoints: list[dict[str, Any]] = []

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        self.steps.append(sample.model_dump(mode="json"))
        self.collectives.append(list(records))

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        self.checkpoints.append(sample.model_dump(mode="json"))

    def close(self) -> None:
        pass


def _rank_main(rank: int, world: int, port: int, out: str, cache: str) -> None:
    """One rank: a full run with checkpoints, then a run resumed from the step-10 checkpoint."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    out_dir = Path(out)
    reports: list[dict[str, Any]] = []

    def report(metrics: dict[str, Any], ckpt: Path | None) -> None:
        kept = None
        if ckpt is not None:  # a temporary root goes when train() returns: keep a copy, as Ray Train would
            kept = out_dir / f"ckpt-{metrics['step']}"
            kept.mkdir(exist_ok=True)
            for f in ckpt.iterdir():
                shutil.copy2(f, kept / f.name)
        reports.append({"metrics": metrics, "checkpoint": None if kept is None else str(kept)})

    sink = RecordingSink()
    ctx = RankContext(rank=rank, world_size=world, job_id="job-loop", report=report, telemetry=sink,
                      report_interval=5, cache_dir=Path(cache))
    full = train(SPEC, ctx)
    assert full.model is not None
    full_params = {k: v.clone() for k, v in full.model.state_dict().items()}

    resumed = train(SPEC, RankContext(rank=rank, world_size=world, job_id="job-loop", cache_dir=Path(cache),
                                      restore_dir=out_dir / "ckpt-10"))
    assert resumed.model is not None
    torch.save({"full": full_params, "resumed": resumed.model.state_dict()}, out_dir / f"params-{rank}.pt")
    (out_dir / f"rank-{rank}.json").write_text(json.dumps({
        "losses": full.losses, "val_losses": full.val_losses, "checkpoints": full.checkpoints,
        "start_step": full.start_step, "final_step": full.final_step, "resumed_start": resumed.start_step,
        "resumed_losses": resumed.losses,
        "steps": sink.steps, "checkpoint_samples": sink.checkpoints,
        "collectives": [[r.__dict__ for r in recs] for recs in sink.collectives],
        "reports": reports,
    }))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loop")
    world = 2
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(out), str(corpus_cache))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0], f"rank exit codes {codes} (None: timed out after {TIMEOUT_S}s)"
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    params = [torch.load(out / f"params-{r}.pt", weights_only=True) for r in range(world)]
    return {"out": out, "ranks": ranks, "params": params}


def test_loss_falls_on_every_rank(two_rank_run: dict[str, Any]) -> None:
    for r in two_rank_run["ranks"]:
        losses = [r["losses"][str(s)] for s in range(1, STEPS + 1)]
        assert all(x is not None and math.isfinite(x) for x in losses)
        assert abs(losses[0] - math.log(256)) < 0.3  # starts at the uniform guess
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    val = two_rank_run["ranks"][0]["val_losses"]
    assert set(val) == {"10", "20"} and val["20"] < math.log(256) - 0.5
    assert two_rank_run["ranks"][1]["val_losses"] == {}  # rank 0 evaluates


def test_ranks_end_with_identical_parameters(two_rank_run: dict[str, Any]) -> None:
    a, b = (p["full"] for p in two_rank_run["params"])
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # ...while the ranks saw different data (so equality comes from the all-reduce, not from luck).
    la, lb = (r["losses"] for r in two_rank_run["ranks"])
    assert la["1"] != lb["1"]


def test_step_samples_for_every_step_from_both_ranks(two_rank_run: dict[str, Any]) -> None:
    for rank, r in enumerate(two_rank_run["ranks"]):
        steps = r["steps"]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        for s, recs in zip(steps, r["collectives"], strict=True):
            StepSample.model_validate(s)
            assert (s["rank"], s["world_size"], s["job_id"]) == (rank, 2, "job-loop")
            assert s["tokens"] == SPEC.batch_size * SPEC.model.context
            assert s["step_time_s"] > 0 and s["tokens_per_s"] > 0
            for key in ("data_s", "fwd_bwd_s", "optim_s", "comm_s"):
                assert s[key] is not None and s[key] >= 0
            assert s["data_s"] + s["fwd_bwd_s"] + s["optim_s"] + s["comm_s"] <= s["step_time_s"] + 1e-6
            # The step's collectives, drained for this step only: AdamW all-reduces the gradients.
            # Step 1 also carries the start-up ones (step 0): rank 0's weights broadcast to all.
            startup = [c for c in recs if c["step"] == 0]
            own = [c for c in recs if c["step"] != 0]
            assert {(c["op"], c["tag"]) for c in startup} == ({("broadcast", "init")} if s["step"] == 1 else set())
            assert own and all(c["step"] == s["step"] for c in own)
            assert ("all_reduce", "grads") in {(c["op"], c["tag"]) for c in own}
            assert [c["seq"] for c in own] == list(range(len(own)))
            assert s["comm_s"] == pytest.approx(sum(c["duration_s"] for c in own))  # the step's own time
            assert s["lr"] == pytest.approx(lr_at(s["step"], SPEC))
        assert [s["step"] for s in steps if s["val_loss"] is not None] == ([10, 20] if rank == 0 else [])


def test_reports_and_checkpoints(two_rank_run: dict[str, Any]) -> None:
    for rank, r in enumerate(two_rank_run["ranks"]):
        # Ray Train hears of a step only with a complete checkpoint (every report blocks on it).
        assert [x["metrics"]["step"] for x in r["reports"]] == [10, 20]
        with_ckpt = [x["metrics"]["step"] for x in r["reports"] if x["checkpoint"]]
        assert with_ckpt == [10, 20] and r["checkpoints"] == [10, 20]
        for x in r["reports"]:
            if x["checkpoint"]:  # a complete checkpoint: every file the manifest lists verifies
                assert (Path(x["checkpoint"]) / MANIFEST_FILE).exists()
                assert verify(Path(x["checkpoint"])).world_size == 2
        # Rank 0 reports each complete checkpoint to its agent.
        samples = r["checkpoint_samples"]
        if rank == 0:
            assert [(s["step"], s["valid"], s["world_size"]) for s in samples] == [(10, True, 2), (20, True, 2)]
            for s in samples:
                assert s["files"] == 3 and s["bytes"] > 0 and len(s["manifest_sha256"]) == 64  # 2 ranks + .metadata
                assert s["loss"] is not None and math.isfinite(s["loss"])
        else:
            assert samples == []
        losses = [x["metrics"]["loss"] for x in r["reports"]]
        assert losses[-1] < losses[0]


def test_resume_from_checkpoint_matches_uninterrupted_run(two_rank_run: dict[str, Any]) -> None:
    for r, p in zip(two_rank_run["ranks"], two_rank_run["params"], strict=True):
        assert r["resumed_start"] == 11
        assert sorted(int(s) for s in r["resumed_losses"]) == list(range(11, STEPS + 1))
        # Bitwise: same weights, optimizer moments, data position and RNG as the run that went on.
        assert r["resumed_losses"] == {k: v for k, v in r["losses"].items() if int(k) > 10}
        for k, v in p["full"].items():
            assert torch.equal(v, p["resumed"][k]), k


def test_two_rank_checkpoint_restores_on_one_rank(two_rank_run: dict[str, Any], corpus_cache: Path) -> None:
    # An elastic restart on fewer ranks: rank 0's state, the step, and training goes on.
    ckpt = two_rank_run["out"] / "ckpt-10"
    summary = train(SPEC, RankContext(rank=0, world_size=1, job_id="job-loop", restore_dir=ckpt,
                                      cache_dir=corpus_cache))
    assert (summary.start_step, summary.final_step) == (11, STEPS)
    assert sorted(summary.losses) == list(range(11, STEPS + 1))
    two_rank_loss_at_11 = two_rank_run["ranks"][0]["losses"]["11"]
    assert summary.losses[11] is not None and abs(summary.losses[11] - two_rank_loss_at_11) < 0.5


def test_lr_schedule() -> None:
    spec = SPEC.model_copy(update={"steps": 100})
    spec = JobCreate.model_validate({**spec.model_dump(), "lr_schedule": {"kind": "cosine", "warmup_steps": 10,
                                                                           "min_lr_ratio": 0.1}})
    peak = spec.optimizer.lr
    assert lr_at(1, spec) == pytest.approx(peak / 10)
    assert lr_at(10, spec) == pytest.approx(peak)
    assert lr_at(55, spec) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert lr_at(100, spec) == pytest.approx(peak * 0.1)
    lrs = [lr_at(s, spec) for s in range(10, 101)]
    assert all(a >= b for a, b in pairwise(lrs))
    const = JobCreate.model_validate({**spec.model_dump(), "lr_schedule": {"kind": "constant", "warmup_steps": 0}})
    assert {lr_at(s, const) for s in (1, 50, 100)} == {peak}


def test_context_is_validated_on_construction() -> None:
    with pytest.raises(ValueError, match="outside world"):
        RankContext(rank=2, world_size=2, job_id="j")
    with pytest.raises(ValueError, match="job id"):
        RankContext(rank=0, world_size=1, job_id="")
    with pytest.raises(ValueError, match="report_interval"):
        RankContext(rank=0, world_size=1, job_id="j", report_interval=0)
    with pytest.raises(ValueError, match="preemption_check_s"):
        RankContext(rank=0, world_size=1, job_id="j", preemption_check_s=-1)


def test_context_must_match_process_group(corpus_cache: Path) -> None:
    with pytest.raises(RuntimeError, match="process group"):
        train(SPEC, RankContext(rank=1, world_size=2, job_id="j", cache_dir=corpus_cache))


def test_pending_preemption_checkpoints_at_once_and_training_goes_on(tmp_path: Path, corpus_cache: Path) -> None:
    spec = JobCreate.model_validate({**SPEC.model_dump(), "steps": 8, "checkpoint": {"interval_steps": 100}})
    calls: list[int] = []
    reported: list[tuple[int, list[str] | None]] = []

    def pending() -> bool:
        calls.append(len(calls) + 1)
        return len(calls) >= 5  # the drain notice arrives at step 5 and stays

    summary = train(spec, RankContext(
        rank=0, world_size=1, job_id="j", cache_dir=corpus_cache, report_interval=3, preemption_pending=pending,
        preemption_check_s=0, checkpoint_root=tmp_path / "ckpt",
        report=lambda m, d: reported.append((m["step"], sorted(p.name for p in d.iterdir()) if d else None)),
    ))
    files = [".metadata", "__0_0.distcp", MANIFEST_FILE]
    # Asked at every step but the last (which checkpoints anyway). The notice made step 5 checkpoint
    # at once, complete, and report it out of turn; training went on to the end, one checkpoint per notice.
    assert calls == [1, 2, 3, 4, 5, 6, 7]
    assert reported == [(5, files), (8, files)]
    assert summary.checkpoints == [5, 8] and summary.final_step == 8


def test_preemption_checks_are_spaced_by_the_slowest_step_time() -> None:
    schedule = PreemptionSchedule(period_s=1.0, first_step=4, distributed=False)
    assert not schedule.due(3) and schedule.due(4)
    schedule.checked(4, step_time_s=0.1)
    assert schedule.next_step == 14  # about one check per second at 0.1 s per step
    schedule = PreemptionSchedule(period_s=1.0, first_step=1, distributed=False)
    schedule.checked(1, step_time_s=5.0)
    assert schedule.next_step == 2  # slow steps: every step
    schedule = PreemptionSchedule(period_s=1.0, first_step=1, distributed=False)
    schedule.checked(1, step_time_s=1e-9)
    assert schedule.next_step == 1 + MAX_PREEMPTION_CHECK_STEPS
    every_step = PreemptionSchedule(period_s=0.0, first_step=7, distributed=False)
    every_step.checked(7, step_time_s=0.1)
    assert every_step.next_step == 8


def test_node_name_comes_from_ray_nodes_else_the_node_id() -> None:
    nodes = [{"NodeID": "aa", "NodeName": "vigil-node-0"}, {"NodeID": "bb", "NodeName": ""}, {"NodeID": "cc"}]
    assert ray_node_name("aa", nodes) == "vigil-node-0"
    assert ray_node_name("bb", nodes) == "bb"
    assert ray_node_name("cc", nodes) == "cc"
    assert ray_node_name("dd", nodes) == "dd"
