"""Every strategy of this family inside the real train loop: eval, checkpoint, exact resume.

Needs torch with gloo and the offline pydoc corpus (cached once per session by the
``corpus_cache`` fixture); one 2-rank run through ``harness.run_ranks`` (127.0.0.1, free port,
under a timeout). Each kind trains the loop's byte-level GPT for a few steps with a checkpoint in
the middle of a period (written and read by ``vigil.checkpointing``), then resumes from it; the
resumed run must end with the same parameters, and the losses must be finite.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_pydoc.gpt_train import train
from tests.vigil.optim.harness import run_ranks
from vigil.contract.schemas import JobCreate
from vigil.sdk import RankContext

TIMEOUT = 300
STEPS, CKPT = 6, 3
KINDS: list[tuple[str, dict]] = [
    ("powersgd", {"start_iter": 2}), ("fp16_compress", {}), ("local_adamw", {"tau": 2}), ("slowmo", {"tau": 2}),
    ("dsm", {"tau": 2}), ("cser", {"rc1": 8, "rc2": 2, "H": 2}), ("cser_pl", {"H": 2}), ("ef_sgd", {}),
    ("qsparse_local_sgd", {"H": 2}), ("compressed_adam", {"compressor": "onebit"}),
]


def _spec(kind: str, params: dict) -> JobCreate:
    return JobCreate.model_validate({
        "name": f"loop-{kind}",
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
        "data": {"max_bytes": 100_000, "seed": 3},
        "optimizer": {"kind": kind, "lr": 3e-3, "params": params},
        "lr_schedule": {"kind": "cosine", "warmup_steps": 1},
        "steps": STEPS, "batch_size": 4, "eval_interval": CKPT,
        "checkpoint": {"interval_steps": CKPT},
    })


def _run(rank: int, world: int, out: str, cache: str) -> list[dict[str, Any]]:
    results = []
    for kind, params in KINDS:
        spec = _spec(kind, params)
        ckpt_dir = Path(out) / kind  # every rank's files of the step-3 checkpoint, as Ray Train would gather them

        def report(metrics: dict[str, Any], ckpt: Path | None, keep: Path = ckpt_dir) -> None:
            if ckpt is not None and metrics["step"] == CKPT:
                shutil.copytree(ckpt, keep, dirs_exist_ok=True)

        ctx = RankContext(rank=rank, world_size=world, job_id="job-optim", report=report, report_interval=1,
                          cache_dir=Path(cache))
        full = train(spec, ctx)
        assert full.model is not None
        resumed = train(spec, RankContext(rank=rank, world_size=world, job_id="job-optim", cache_dir=Path(cache),
                                          restore_dir=ckpt_dir))
        assert resumed.model is not None
        results.append({
            "losses": full.losses, "val": full.val_losses, "resumed_losses": resumed.losses,
            "full": [p.detach().clone() for p in full.model.parameters()],
            "resumed": [p.detach().clone() for p in resumed.model.parameters()],
        })
    return results


@pytest.mark.timeout(TIMEOUT)
def test_every_strategy_trains_evaluates_and_resumes_exactly_in_the_loop(
    tmp_path: Path, corpus_cache: Path
) -> None:
    per_rank = run_ranks(2, _run, str(tmp_path), str(corpus_cache), timeout=TIMEOUT)
    for rank, results in enumerate(per_rank):
        for (kind, _), res in zip(KINDS, results, strict=True):
            assert all(v is not None and math.isfinite(v) for v in res["losses"].values()), kind
            assert res["resumed_losses"] == {s: v for s, v in res["losses"].items() if s > CKPT}, kind
            for a, b in zip(res["full"], res["resumed"], strict=True):
                assert torch.equal(a, b), (kind, rank)
            if rank == 0:
                assert set(res["val"]) == {CKPT, STEPS}, kind
