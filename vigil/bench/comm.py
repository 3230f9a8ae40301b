"""Bits on the wire per optimizer, measured: ``python -m vigil.bench comm [--json] [--steps N]``.

Spawns ``--world`` (4) gloo ranks on this machine; for every optimizer configuration below each
rank builds the same small byte-level GPT, runs ``--steps`` real training steps (forward,
backward, ``strategy.step``) on random bytes of its own, and keeps the communication layer's
records. Nothing is computed from formulas: every number comes from :class:`vigil.comm.Comm`.

Output (``--json``: a JSON list; otherwise a table), one entry per configuration:

* ``optimizer``: the configuration's name (the ``optimizer.kind``), ``params``: its ``optimizer.params``;
* ``payload_bits_per_param_step``: sum of payload bits over the steps / (model parameters x steps),
  averaged over ranks (fp32 DDP all-reduce = 32);
* ``components``: per tag (``grads``, ``sync``, ``push``, ``pull``, ``weights``, ...): payload bits
  per communicated model element over all ranks and steps (e.g. 1 + 32/chunk for onebit push);
* ``wire_bytes_per_step``: ring-equivalent bytes sent per rank and step;
* ``step_time_s``: mean over steps (the first left out: warm-up) of the slowest rank's step time;
* ``model_params``, ``steps``, ``world_size``; ``skipped`` (with the reason) when the optimizer's
  module is not importable, ``error`` when it failed.

The periods of the default configurations (tau = 12, H = 8) divide the default 24 steps, so the
averages cover whole periods. SDP4Bit configurations get ``ranks_per_node=2``: 4 ranks form two
"nodes" of two, so both its intra-node and inter-node groups exist on one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vigil.bench.ranks import run_ranks
from vigil.comm import Comm
from vigil.contract.schemas import ModelSpec, OptimizerSpec
from vigil.model import build_model
from vigil.optim import build_strategy

log = logging.getLogger(__name__)

MODEL = ModelSpec.model_validate({"n_layer": 2, "n_head": 2, "d_model": 64, "context": 32})
"""About 0.12M parameters: big enough for every compressor's groups, small enough for one CPU thread."""
BATCH = 4
LR = 1e-3


@dataclass(frozen=True)
class BenchConfig:
    """One optimizer configuration of the benchmark."""

    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


SDP4BIT_NODES = {"ranks_per_node": 2}

CONFIGS: list[BenchConfig] = [
    BenchConfig("adamw", "adamw"),
    BenchConfig("fp16_compress", "fp16_compress"),
    BenchConfig("powersgd", "powersgd", {"rank": 1, "start_iter": 2}),
    BenchConfig("local_adamw", "local_adamw", {"tau": 12}),
    # One all-reduce per sync (replicated outer state): the 32/tau of ALGORITHMS.md. The sharded
    # variants move the same wire bytes, but the all-gather half counts as extra payload.
    BenchConfig("slowmo", "slowmo", {"tau": 12, "sharded": False}),
    BenchConfig("dsm", "dsm", {"tau": 12, "sharded": False}),
    BenchConfig("slowmo_sharded", "slowmo", {"tau": 12, "sharded": True}),
    BenchConfig("dsm_sharded", "dsm", {"tau": 12, "sharded": True}),
    BenchConfig("sdp4bit", "sdp4bit", SDP4BIT_NODES),
    BenchConfig("sdp4bit_qw", "sdp4bit_qw", SDP4BIT_NODES),
    BenchConfig("sdp4bit_tlq", "sdp4bit_tlq", SDP4BIT_NODES),
    BenchConfig("sdp4bit_ulq", "sdp4bit_ulq", SDP4BIT_NODES),
    BenchConfig("cser", "cser", {"rc1": 32, "rc2": 4, "H": 8}),
    BenchConfig("cser_pl", "cser_pl", {"rc2": 4, "H": 8}),
    BenchConfig("ef_sgd", "ef_sgd", {"ratio": 16}),
    BenchConfig("qsparse_local_sgd", "qsparse_local_sgd", {"ratio": 2, "H": 8}),
    BenchConfig("compressed_adam", "compressed_adam", {"compressor": "onebit"}),
]


def _run_config(rank: int, cfg: BenchConfig, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(MODEL)
    n_params = sum(p.numel() for p in model.parameters())
    comm = Comm.from_process_group()
    spec = OptimizerSpec.model_validate({"kind": cfg.kind, "lr": LR, "params": cfg.params})
    try:
        strategy = build_strategy(spec, model, comm)
    except ValueError as exc:
        if isinstance(exc.__cause__, ImportError | AttributeError):
            return {"skipped": str(exc)}
        return {"error": f"{type(exc).__name__}: {exc}"}
    comm.drain()  # the initial broadcast is not a training step's traffic
    gen = torch.Generator().manual_seed(1000 + rank)
    bits: dict[str, int] = {}
    elements: dict[str, int] = {}
    payload_bits = wire_bytes = 0
    times: list[float] = []
    try:
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 256, (BATCH, MODEL.context + 1), generator=gen)
            comm.set_step(step)
            t0 = time.perf_counter()
            strategy.zero_grad()
            _, loss = strategy.model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            strategy.step(step, LR)
            for r in comm.drain():
                tag = r.tag or "untagged"
                bits[tag] = bits.get(tag, 0) + 8 * r.payload_bytes
                elements[tag] = elements.get(tag, 0) + r.elements
                payload_bits += 8 * r.payload_bytes
                wire_bytes += r.wire_bytes
            times.append(time.perf_counter() - t0)
    except Exception as exc:  # reported per configuration; the others still run
        log.exception("rank %d: %s failed", rank, cfg.name)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"n_params": n_params, "payload_bits": payload_bits, "wire_bytes": wire_bytes, "bits": bits,
            "elements": elements, "times": times}


def _rank_main(rank: int, world: int, steps: int, configs: list[BenchConfig]) -> list[dict[str, Any]]:
    logging.getLogger("torch").setLevel(logging.ERROR)
    return [_run_config(rank, cfg, steps) for cfg in configs]


def summarize(cfg: BenchConfig, per_rank: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One output entry from the ranks' raw counts of one configuration."""
    entry: dict[str, Any] = {"optimizer": cfg.name, "params": cfg.params}
    for key in ("skipped", "error"):
        reasons = sorted({r[key] for r in per_rank if key in r})
        if reasons:
            entry[key] = "; ".join(reasons)
            return entry
    n = per_rank[0]["n_params"]
    tags = sorted({t for r in per_rank for t in r["bits"]})
    components = {}
    for tag in tags:
        total_elements = sum(r["elements"].get(tag, 0) for r in per_rank)
        if total_elements:
            components[tag] = round(sum(r["bits"].get(tag, 0) for r in per_rank) / total_elements, 4)
    per_step = list(zip(*(r["times"] for r in per_rank), strict=True))
    slowest = [max(t) for t in per_step[1:]] or [max(per_step[0])]
    entry.update(
        payload_bits_per_param_step=round(statistics.fmean(r["payload_bits"] for r in per_rank) / (n * steps), 4),
        components=components,
        wire_bytes_per_step=round(statistics.fmean(r["wire_bytes"] for r in per_rank) / steps, 1),
        step_time_s=round(statistics.fmean(slowest), 5),
        model_params=n,
        steps=steps,
        world_size=len(per_rank),
    )
    return entry


def run(steps: int = 24, world: int = 4, configs: list[BenchConfig] | None = None, timeout: float = 240.0) -> list[dict]:
    """Run the benchmark; one summary entry per configuration."""
    configs = CONFIGS if configs is None else configs
    results = run_ranks(world, _rank_main, steps, configs, timeout=timeout)
    return [summarize(cfg, [results[r][i] for r in range(world)], steps) for i, cfg in enumerate(configs)]


def _table(entries: list[dict[str, Any]]) -> str:
    lines = [f"{'optimizer':<18} {'b/p/step':>9} {'wire B/step':>12} {'step s':>8}  components (bits/element)"]
    for e in entries:
        if "payload_bits_per_param_step" not in e:
            lines.append(f"{e['optimizer']:<18} {'skipped' if 'skipped' in e else 'error'}: {e.get('skipped') or e.get('error')}")
            continue
        comps = ", ".join(f"{k}={v:g}" for k, v in e["components"].items())
        lines.append(
            f"{e['optimizer']:<18} {e['payload_bits_per_param_step']:>9.3f} {e['wire_bytes_per_step']:>12.0f} "
            f"{e['step_time_s']:>8.4f}  {comps}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vigil.bench comm", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--steps", type=int, default=24, help="training steps per optimizer (default 24)")
    parser.add_argument("--world", type=int, default=4, help="gloo ranks on this machine (default 4)")
    parser.add_argument("--only", default="", help="comma-separated optimizer names to run (default: all)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.world < 1:
        parser.error("--steps and --world must be >= 1")
    configs = CONFIGS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in CONFIGS}
        if unknown:
            parser.error(f"unknown optimizers {sorted(unknown)}")
        configs = [c for c in CONFIGS if c.name in wanted]
    entries = run(args.steps, args.world, configs)
    sys.stdout.write((json.dumps(entries, indent=1) if args.json else _table(entries)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
