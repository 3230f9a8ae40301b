"""The small reproduction of ALGORITHMS.md: ``python -m vigil.bench.convergence [--quick] [--json]``.

Every method trains the same byte-level GPT with the bundled GPT example on the rank API (:mod:`examples.gpt_pydoc.gpt_train`)
on ``--world`` (4) gloo ranks of this machine, each rank on its own disjoint shard of the offline
pydoc corpus, with the same seeds, steps, batch and learning-rate schedule (so the same token
budget) for every method of a family. Reported per method:

* ``payload_bits_per_param_step``: MEASURED by the communication layer (the loop hands every
  step's :class:`~vigil.comm.CollectiveRecord` list to its telemetry sink; this benchmark's sink
  adds them up): payload bits over the training steps / (model parameters x steps), mean over
  ranks. The start-up broadcast (tag ``init``) and the all-reduce that builds the evaluation
  model of local-step methods (tag ``eval``) are not training traffic and are left out;
* ``val_loss_mean`` / ``val_loss_std`` over seeds at the last step (the same validation batches
  for every method: :func:`vigil.data.build_samplers`), the curve at every ``eval_interval``.
  The evaluated model is the strategy's ``eval_module()``: the average of the local models for
  Local AdamW / SlowMo / DSM, the synchronised model x_i - e_i for CSER and QSparse;
* ``val_loss_rank0_model``: the validation loss of rank 0's own model as training left it (mean
  over seeds; equal to ``val_loss_mean`` where every rank holds the evaluated model);
* ``train_loss_last10``: the ranks' own training loss over the last 10 steps (their local models),
  which differs from the validation loss where the evaluated model is not what the ranks train;
* ``gap_to_baseline`` (and ``gap_pct``): the mean over seeds of ``val_loss - baseline val_loss``
  of the *same* seed (paired: same initial weights and data), with its std, against the family's
  uncompressed baseline: DDP AdamW for the AdamW family, ZeRO-1 AdamW (``sdp4bit`` with fp32
  weights and gradients) for the SDP4Bit ablation, synchronous Nesterov-momentum SGD for CSER and
  its baselines.

The comparisons (``comparisons`` in the JSON, each with the published claim and explicit checks):

* **sdp4bit_ablation**: baseline, qW, qWD, TLq, TLq-HS, SDP4Bit with ``ranks_per_node=2`` (two
  "nodes" of two ranks, so both the intra-node and the inter-node hop exist);
* **local_steps**: Local AdamW, SlowMo and DSM-LS at tau = 12 (next to DDP AdamW);
* **cser_r16 / cser_r64 / cser_r256**: CSER, EF-SGD and QSparse-local-SGD at the same overall
  compression ratio R (32/R b/p/step): CSER ``rc1 = 2R``, ``H = rc1/rc2`` (the paper's choice, so
  R = rc1/2); EF-SGD ``ratio = R``; QSparse ``H * ratio = R`` with CSER's H;
* **compressed_adam**: two-way onebit compressed AdamW with and without error feedback.

``quant_errors``: ALGORITHMS.md §2's argument measured on the model mid-training (DDP AdamW,
warmup then constant lr, to step ``steps // 2``; a second run to one step further gives the weight
difference of one optimizer step, ``D = W_{k+1} - W_k``, which is what qWD quantizes against an
fp32 replica): ``||Q(x) - x|| / ||x||`` for the weights and for D (4-bit, group 2048), the error
each puts into the weights (relative to ``||W||``), and for every rank's local gradient at W_k
with and without the order-32 Hadamard transform (8-bit and 4-bit, group 128), mean over ranks.
Quantization is :func:`vigil.quant.quantize` (stochastic rounding), as SDP4Bit uses it.

Budget (one thread per rank, 4 ranks on a shared 2-core machine): the model is 2 layers, d = 64,
context 64 (0.12M parameters, smaller than ALGORITHMS.md's ~1M example, which would be ~8x slower
per step), 16 sequences per rank and step. ``--quick``: 96 steps, seed 0, the sensitivity rows
left out (22 runs; 5-9 minutes measured, with the machine's load average at 15-35 from other work).
Default (full): 192 steps, seeds 0, 1, 2 for the key comparisons (every method except the
sensitivity rows, which get seed 0): 70 runs (58 runs took 26-29 minutes at the same load, when
CSER / EF-SGD / QSparse at R = 16 and 64 had one seed). Step counts are multiples of 96 so that every period (tau = 12;
H = 8, 16, 32) ends exactly at the last step.

Output: ``--json`` prints ``{"meta", "methods", "comparisons", "quant_errors"}``; ``--markdown``
prints the tables as Markdown (docs/BENCHMARKS.md); otherwise a readable table. ``--out FILE``
also writes the JSON there, ``--plot FILE`` draws the figure (PNG with matplotlib; without
matplotlib an SVG bar chart of the gaps drawn here); ``--from FILE`` re-renders a saved result
without running anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from examples.gpt_pydoc.gpt_train import evaluate, train
from vigil import quant
from vigil.bench.convergence_report import add_gaps, compare, plot, summarize_method, table
from vigil.bench.ranks import RankFailure, run_ranks
from vigil.comm import CollectiveRecord
from vigil.contract.schemas import JobCreate, ModelSpec, StepSample
from vigil.data import build_samplers
from vigil.sdk import RankContext

log = logging.getLogger(__name__)

from vigil.bench.convergence_methods import (
    ADAMW_LR,
    BATCH,
    BY_NAME,
    COMPARISONS,
    EXCLUDED_TAGS,
    FULL_STEPS,
    GRAD_GROUP,
    HADAMARD_ORDER,
    KEY_SEEDS,
    MAX_BYTES,
    METHODS,
    MIN_LR_RATIO,
    MODEL,
    QUICK_STEPS,
    RANKS_PER_NODE,
    RUNS_PER_LAUNCH,
    SENSITIVITY,
    SGD_LR,
    SGD_WEIGHT_DECAY,
    WARMUP_FRACTION,
    WEIGHT_GROUP,
    WORLD,
    Method,
)


class PayloadSink:
    """Telemetry sink that adds up what the loop reports: payload and wire bytes per tag, step times."""

    def __init__(self) -> None:
        self.bits: dict[str, int] = {}
        self.elements: dict[str, int] = {}
        self.wire_bytes = 0
        self.excluded_bits = 0
        self.step_times: list[float] = []

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        self.step_times.append(sample.step_time_s)
        for r in records:
            if r.tag in EXCLUDED_TAGS or r.step < 1:
                self.excluded_bits += 8 * r.payload_bytes
                continue
            tag = r.tag or "untagged"
            self.bits[tag] = self.bits.get(tag, 0) + 8 * r.payload_bytes
            self.elements[tag] = self.elements.get(tag, 0) + r.elements
            self.wire_bytes += r.wire_bytes

    def send_checkpoint(self, sample: Any) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class Setup:
    """What every run shares: shape, steps, schedule."""

    steps: int
    eval_interval: int
    model: dict[str, Any] = field(default_factory=lambda: MODEL.model_dump())
    batch_size: int = BATCH
    max_bytes: int = MAX_BYTES
    adamw_lr: float = ADAMW_LR
    sgd_lr: float = SGD_LR

    @property
    def warmup(self) -> int:
        return max(1, round(self.steps * WARMUP_FRACTION))


def job_spec(method: Method, seed: int, setup: Setup, *, steps: int | None = None,
             schedule: str = "cosine") -> JobCreate:
    """The job spec of one run: the method's optimizer on the shared model, data and schedule."""
    params = dict(method.params)
    if method.seeded:
        params["seed"] = seed
    sgd = method.family == "sgd"
    optimizer: dict[str, Any] = {"kind": method.kind, "lr": setup.sgd_lr if sgd else setup.adamw_lr, "params": params}
    if sgd:
        optimizer["weight_decay"] = SGD_WEIGHT_DECAY
    return JobCreate.model_validate({
        "name": f"convergence-{method.name}",
        "model": setup.model,
        "data": {"max_bytes": setup.max_bytes, "seed": seed},
        "optimizer": optimizer,
        "lr_schedule": {"kind": schedule, "warmup_steps": setup.warmup, "min_lr_ratio": MIN_LR_RATIO},
        "steps": steps if steps is not None else setup.steps,
        "batch_size": setup.batch_size,
        "eval_interval": setup.eval_interval,
    })


def _one_run(rank: int, world: int, method: Method, seed: int, setup: Setup, cache: str | None) -> dict[str, Any]:
    sink = PayloadSink()
    ctx = RankContext(rank=rank, world_size=world, job_id=f"convergence-{method.name}-s{seed}", telemetry=sink,
                      async_checkpoints=False, cache_dir=Path(cache) if cache else None)
    t0 = time.perf_counter()
    try:
        summary = train(job_spec(method, seed, setup), ctx)
    except Exception as exc:  # reported per run; the other runs still go ahead
        log.exception("rank %d: %s seed %d failed", rank, method.name, seed)
        return {"error": f"{type(exc).__name__}: {exc}"}
    assert summary.model is not None
    local_val = None
    if rank == 0:
        # Rank 0's own model as training left it, on the same validation batches: the model a
        # worker of CSER / QSparse actually trains (x_i), next to the synchronised one evaluated.
        spec = job_spec(method, seed, setup)
        _, val_data = build_samplers(spec.data, spec.batch_size, spec.model.context, rank, world, ctx.cache_dir)
        local_val = evaluate(summary.model, val_data)
    return {
        "n_params": sum(p.numel() for p in summary.model.parameters()),
        "val": summary.val_losses,
        "local_val": local_val,
        "losses": summary.losses,
        "bits": sink.bits,
        "elements": sink.elements,
        "wire_bytes": sink.wire_bytes,
        "step_times": sink.step_times,
        "wall_s": time.perf_counter() - t0,
    }


def _rank_runs(rank: int, world: int, runs: list[tuple[Method, int]], setup: Setup,
               cache: str | None) -> list[dict[str, Any]]:
    logging.getLogger("torch").setLevel(logging.ERROR)
    return [_one_run(rank, world, m, seed, setup, cache) for m, seed in runs]


def _flat(tensors: Sequence[torch.Tensor], multiple: int) -> torch.Tensor:
    x = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    return torch.nn.functional.pad(x, (0, -x.numel() % multiple))


def _roundtrip(x: torch.Tensor, bits: int, group: int, key: tuple[int, int]) -> torch.Tensor:
    values, scales = quant.quantize(x, bits, group, key, pack=False)
    return quant.dequantize(values, scales, group)


def _rank_quant_errors(rank: int, world: int, setup: Setup, cache: str | None) -> dict[str, float]:
    """Relative quantization errors on this rank's weights, weight difference and local gradient."""
    logging.getLogger("torch").setLevel(logging.ERROR)
    method = BY_NAME["adamw"]
    k = max(1, setup.steps // 2)
    cache_dir = Path(cache) if cache else None

    def run_to(steps: int) -> torch.nn.Module:
        ctx = RankContext(rank=rank, world_size=world, job_id="convergence-quant", async_checkpoints=False,
                          cache_dir=cache_dir)
        # Constant lr after warmup: the run to k and the run to k + 1 take identical first k steps.
        model = train(job_spec(method, 0, setup, steps=steps, schedule="constant"), ctx).model
        assert model is not None
        return model

    model = run_to(k)
    multiple = math.lcm(WEIGHT_GROUP, GRAD_GROUP, HADAMARD_ORDER)
    w_k = _flat(list(model.parameters()), multiple)
    # The local gradient this rank computes at step k + 1: its training batch number k (0-based).
    spec = job_spec(method, 0, setup, steps=k + 1, schedule="constant")
    train_data, _ = build_samplers(spec.data, spec.batch_size, spec.model.context, rank, world, cache_dir)
    x, y = train_data.sample(k)
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    assert loss is not None
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    g = _flat(grads, multiple)
    w_next = _flat(list(run_to(k + 1).parameters()), multiple)
    d = w_next - w_k

    key = quant.stream_key(12345, rank)
    w_q = _roundtrip(w_next, 4, WEIGHT_GROUP, key)
    d_q = _roundtrip(d, 4, WEIGHT_GROUP, key)
    out = {
        "weights_q4": quant.relative_error(w_q, w_next),
        "weight_diff_q4": quant.relative_error(d_q, d),
        # What each scheme adds to the weights it produces, relative to the weights.
        "weights_q4_error_in_weights": quant.relative_error(w_q, w_next),
        "weight_diff_q4_error_in_weights": float(torch.linalg.vector_norm(d_q - d) / torch.linalg.vector_norm(w_next)),
        "weight_diff_norm_over_weight_norm": float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(w_next)),
    }
    for bits in (8, 4):
        plain = _roundtrip(g, bits, GRAD_GROUP, key)
        rotated = quant.inverse_hadamard(_roundtrip(quant.hadamard(g, HADAMARD_ORDER), bits, GRAD_GROUP, key),
                                         HADAMARD_ORDER)
        out[f"grad_q{bits}"] = quant.relative_error(plain, g)
        out[f"grad_q{bits}_hadamard"] = quant.relative_error(rotated, g)
    # Why the transform helps or not: an absmax quantizer's error grows with each group's peak-to-RMS
    # ratio; the Hadamard transform lowers it for groups with a few outliers and raises it for
    # groups whose elements are correlated (it concentrates their common part in one coefficient).
    out["grad_group_peak_to_rms"] = _peak_to_rms(g, GRAD_GROUP)
    out["grad_hadamard_group_peak_to_rms"] = _peak_to_rms(quant.hadamard(g, HADAMARD_ORDER), GRAD_GROUP)
    better = total = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        t = _flat([p.grad], GRAD_GROUP)
        rotated = quant.inverse_hadamard(_roundtrip(quant.hadamard(t, HADAMARD_ORDER), 4, GRAD_GROUP, key),
                                         HADAMARD_ORDER)
        total += p.numel()
        if quant.relative_error(rotated, t) < quant.relative_error(_roundtrip(t, 4, GRAD_GROUP, key), t):
            better += p.numel()
    out["grad_q4_hadamard_better_share"] = better / max(1, total)
    return out


def _peak_to_rms(x: torch.Tensor, group: int) -> float:
    """Mean over groups of max|x| / RMS(x) (groups of zeros left out)."""
    groups = x.reshape(-1, group)
    rms = groups.pow(2).mean(-1).sqrt()
    keep = rms > 0
    return float((groups.abs().amax(-1)[keep] / rms[keep]).mean()) if bool(keep.any()) else 0.0


# -- summaries ------------------------------------------------------------------------------------


def plan(methods: Sequence[Method], seeds: Sequence[int]) -> list[tuple[Method, int]]:
    """Every (method, seed) run: key methods (and every baseline they need) get all ``seeds``."""
    needed = {m.name for m in methods}
    runs: list[tuple[Method, int]] = []
    for m in METHODS:
        if m.name in needed:
            runs.extend((m, s) for s in (seeds if m.key else seeds[:1]))
    return runs


def run(
    steps: int = FULL_STEPS, seeds: Sequence[int] = KEY_SEEDS, methods: Sequence[str] | None = None,
    world: int = WORLD, eval_interval: int | None = None, quant_errors: bool = True, model: ModelSpec | None = None,
    batch_size: int = BATCH, max_bytes: int = MAX_BYTES, cache_dir: str | None = None, adamw_lr: float = ADAMW_LR,
    sgd_lr: float = SGD_LR, timeout_per_run: float | None = None,
) -> dict[str, Any]:
    """Run the benchmark; the JSON object described in the module docstring.

    ``methods``: names from :data:`METHODS` (their baselines are added); None: all of them.
    """
    t_start = time.perf_counter()
    names = [m.name for m in METHODS] if methods is None else list(methods)
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {sorted(BY_NAME)}")
    names += [BY_NAME[n].baseline for n in names]
    chosen = [m for m in METHODS if m.name in set(names)]
    setup = Setup(
        steps=steps, eval_interval=eval_interval if eval_interval is not None else max(1, steps // 8),
        model=(model or MODEL).model_dump(), batch_size=batch_size, max_bytes=max_bytes, adamw_lr=adamw_lr,
        sgd_lr=sgd_lr,
    )
    runs = plan(chosen, list(seeds))
    per_run_s = timeout_per_run if timeout_per_run is not None else 60.0 + 2.0 * steps
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {m.name: {} for m in chosen}
    for i in range(0, len(runs), RUNS_PER_LAUNCH):
        batch = runs[i : i + RUNS_PER_LAUNCH]
        t0 = time.perf_counter()
        try:
            results = run_ranks(world, _rank_runs, batch, setup, cache_dir, timeout=per_run_s * len(batch))
            per_run = [[results[r][j] for r in range(world)] for j in range(len(batch))]
        except RankFailure as exc:
            log.error("runs %s failed: %s", [f"{m.name}/{s}" for m, s in batch], exc)
            per_run = [[{"error": f"RankFailure: {str(exc)[-500:]}"}] * world for _ in batch]
        for (m, s), ranks in zip(batch, per_run, strict=True):
            raw[m.name][s] = ranks
        log.info("runs %d-%d of %d done in %.0f s (%s)", i + 1, i + len(batch), len(runs),
                 time.perf_counter() - t0, ", ".join(f"{m.name}/{s}" for m, s in batch))
    entries = [summarize_method(m, raw[m.name], steps) for m in chosen]
    add_gaps(entries)
    comparisons = compare(entries)
    errors: dict[str, Any] | None = None
    if quant_errors:
        try:
            per_rank = run_ranks(world, _rank_quant_errors, setup, cache_dir, timeout=per_run_s * 2)
            errors = {k: round(statistics.fmean(r[k] for r in per_rank), 5) for k in per_rank[0]}
            errors["at_step"] = max(1, steps // 2)
        except RankFailure as exc:
            log.error("quantization errors failed: %s", exc)
            errors = {"error": f"RankFailure: {str(exc)[-500:]}"}
    n_params = next((e["model_params"] for e in entries if "model_params" in e), None)
    meta = {
        "world_size": world, "ranks_per_node_sdp4bit": RANKS_PER_NODE, "model": setup.model, "model_params": n_params,
        "batch_size": batch_size, "steps": steps, "tokens_per_rank": steps * batch_size * setup.model["context"],
        "eval_interval": setup.eval_interval, "seeds": list(seeds), "runs": len(runs),
        "schedule": f"cosine, warmup {setup.warmup} steps, floor {MIN_LR_RATIO} x peak",
        "adamw": {"lr": adamw_lr, "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0},
        "sgd": {"lr": sgd_lr, "weight_decay": SGD_WEIGHT_DECAY, "momentum": 0.9, "nesterov": True},
        "max_bytes": max_bytes, "torch": torch.__version__, "threads_per_rank": 1,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    return {"meta": meta, "methods": entries, "comparisons": comparisons, "quant_errors": errors}


# -- output ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vigil.bench.convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps, seed 0, no sensitivity rows (a smoke run: 5-9 minutes)")
    parser.add_argument("--json", action="store_true", help="print the JSON object instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--steps", type=int, help=f"steps per run (default {FULL_STEPS}; --quick {QUICK_STEPS})")
    parser.add_argument("--seeds", type=int, help=f"seeds of the key comparisons (default {len(KEY_SEEDS)}; --quick 1)")
    parser.add_argument("--only", default="", help="comma-separated method names (their baselines are added)")
    parser.add_argument("--world", type=int, default=WORLD, help=f"gloo ranks (default {WORLD})")
    parser.add_argument("--adamw-lr", type=float, default=ADAMW_LR)
    parser.add_argument("--sgd-lr", type=float, default=SGD_LR)
    parser.add_argument("--no-quant-errors", action="store_true", help="skip the quantization-error measurement")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--plot", type=Path, help="draw the figure to this file (PNG; SVG without matplotlib)")
    parser.add_argument("--from", dest="from_json", type=Path, metavar="FILE",
                        help="do not run: re-render the result saved by --out FILE")
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    n_seeds = args.seeds or (1 if args.quick else len(KEY_SEEDS))
    if steps < 1 or n_seeds < 1 or args.world < 1:
        parser.error("--steps, --seeds and --world must be >= 1")
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(BY_NAME)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.from_json:
        # Re-render a saved result (tables, checks and figure from the current code; nothing runs).
        result = json.loads(args.from_json.read_text())
        add_gaps(result["methods"])
        result["comparisons"] = compare(result["methods"])
    else:
        if args.quick and not only:
            only = [m.name for m in METHODS if m.name not in SENSITIVITY]
        result = run(steps=steps, seeds=list(range(n_seeds)), methods=only or None, world=args.world,
                     quant_errors=not args.no_quant_errors, adamw_lr=args.adamw_lr, sgd_lr=args.sgd_lr)
        result["meta"]["mode"] = "quick" if args.quick else "full"
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.plot:
        log.info("figure: %s", plot(result, args.plot))
    sys.stdout.write((text if args.json else table(result, markdown=args.markdown)) + "\n")
    return 0


if __name__ == "__main__":
    # Re-import under the package name, so that the functions and dataclasses the rank processes
    # receive are pickled as vigil.bench.convergence.*, not as this __main__ module's.
    from vigil.bench.convergence import main as _main

    sys.exit(_main())


__all__ = [
    "BY_NAME", "COMPARISONS", "METHODS", "SENSITIVITY", "Method", "add_gaps", "main", "plan", "plot", "run", "table",
]
