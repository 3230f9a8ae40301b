"""Speedup over DDP AdamW at limited bandwidth: ``vigil bench speedup [--json]`` (root, Linux, iproute2).

Four nodes, one rank each, every node in its own network namespace with a veth ``eth0`` shaped by
``tc`` (ops/netns.py: HTB at the link rate, both ways). The ranks are plain
torch.distributed processes (:mod:`vigil.bench.netns_ranks`: each enters its namespace, then
joins gloo over ``eth0``), not Ray Train workers: the same collectives on the same sockets, without
Ray's start-up cost on a small machine. For every link speed (default 1gbit, 200mbit, 50mbit) the
links are re-shaped, the four ranks start once and run every optimizer of
:data:`vigil.optim.REGISTRY` in turn with the same model, the same batches and the same number of
steps (the same token budget), separated by barriers. The model is sized so that DDP's gradient
all-reduce dominates a step at the slowest link, as it does for large models on real clusters,
while the compute of a step stays small (few tokens per step).

Per optimizer and link (``--json``: a list of objects):

* ``optimizer``, ``params``, ``link`` (tc rate), ``link_bps``;
* ``step_time_s``: mean over the measured steps of the slowest rank's step time (forward, backward,
  ``strategy.step``, every collective included);
* ``comm_time_s``: mean per step of the time ranks spent inside collectives (the communication
  layer's own timing, averaged over ranks);
* ``tokens_per_s``: tokens of all ranks per step / ``step_time_s``;
* ``speedup_vs_adamw``: DDP AdamW's ``step_time_s`` at the same link, measured in the same run,
  divided by this one's;
* ``wire_bytes_per_step`` (ring-equivalent, from the communication layer) and
  ``nic_tx_bytes_per_step`` (the namespace's real ``eth0`` counter, per rank: protocol overhead,
  retransmissions and all), ``model_params``, ``steps``, ``world_size``; ``error`` when it failed.

Periodic methods use their ``vigil bench comm`` periods (tau = 12, H = 8); two warm-up steps are left
out (compilation happens there) and the 24 measured steps hold whole periods of both. SDP4Bit runs
with ``ranks_per_node=1`` (each namespace is a node of one rank, so every gradient hop is
inter-node, 4-bit) and ``compile=True``: its quantization, packing and Hadamard kernels fused by
``torch.compile``, as the paper's are fused CUDA kernels (eagerly, on a shared CPU core, they cost
about as much as the communication they save).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ops import netns
from vigil import sdk
from vigil.bench.comm import CONFIGS as COMM_CONFIGS
from vigil.bench.comm import BenchConfig
from vigil.bench.netns_ranks import enter_namespace, nic_bytes
from vigil.bench.ranks import run_ranks
from vigil.comm import CollectiveRecord
from vigil.contract.link import parse_rate
from vigil.contract.schemas import JobCreate, ModelSpec, StepSample
from vigil.model import build_model
from vigil.optim import REGISTRY

log = logging.getLogger(__name__)

MODEL = ModelSpec.model_validate({"n_layer": 4, "n_head": 4, "d_model": 256, "context": 16})
"""About 3.2M parameters: DDP moves 1.5 x 12.7 MB per rank and step (~3 s at 50 Mbit/s)."""
BATCH = 1
"""Sequences per rank and step: few tokens (16), so compute stays well below DDP's communication."""
LR = 1e-3
LINKS = ("1gbit", "200mbit", "50mbit")
BASELINE = "adamw"
SDP4BIT_PARAMS = {"ranks_per_node": 1, "compile": True}
"""Each namespace is a node of one rank; quantization kernels fused by torch.compile (the paper's are fused
CUDA kernels; eager CPU kernels would cost more than the communication they save)."""


def configs() -> list[BenchConfig]:
    """One configuration per kind of :data:`REGISTRY`, with ``vigil bench comm``'s parameters."""
    by_name = {c.name: c for c in COMM_CONFIGS}
    out = []
    for kind in REGISTRY:
        params = dict(by_name[kind].params) if kind in by_name else {}
        if kind.startswith("sdp4bit"):
            params.update(SDP4BIT_PARAMS)
        out.append(BenchConfig(kind, kind, params))
    out.sort(key=lambda c: c.name != BASELINE)  # the baseline first
    return out


class _Sink:
    """Keeps this rank's step samples and collective records (the rank API's telemetry, in memory)."""

    def __init__(self) -> None:
        self.steps: list[tuple[StepSample, list[CollectiveRecord]]] = []

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        self.steps.append((sample, list(records)))

    def send_checkpoint(self, sample: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _run_config(rank: int, cfg: BenchConfig, steps: int, warmup: int, model_spec: ModelSpec,
                batch: int) -> dict[str, Any]:
    """One optimizer on this rank through the public rank API (:mod:`vigil.sdk`), as a user's loop runs it."""
    world = dist.get_world_size()
    sink = _Sink()
    ctx = sdk.RankContext(rank=rank, world_size=world, job_id=f"speedup-{cfg.name.replace('_', '-')}",
                          telemetry=sink, async_checkpoints=False)
    job = JobCreate.model_validate({"name": f"speedup-{cfg.name}", "steps": warmup + steps,
                                    "checkpoint": {"interval_steps": 0}})
    out: dict[str, Any] = {}
    tx: list[int] = []

    def loop(config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = build_model(model_spec)
        out["n_params"] = sum(p.numel() for p in model.parameters())
        opt = sdk.optimizer(model, cfg.kind, lr=LR, params=cfg.params)
        gen = torch.Generator().manual_seed(1000 + rank)
        dist.barrier()
        for step in range(1, warmup + steps + 1):
            if step == warmup + 1:
                tx.append(nic_bytes()[0])
            tokens = torch.randint(0, 256, (batch, model_spec.context + 1), generator=gen)
            with sdk.step(step) as s:
                opt.zero_grad()
                _, loss = opt.model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                opt.step(LR)
                s.report(loss, tokens=batch * model_spec.context)
        tx.append(nic_bytes()[0])
        dist.barrier()

    try:
        sdk.run(loop, ctx, job)
    except Exception as exc:  # reported per configuration; the others still run
        log.exception("rank %d: %s failed", rank, cfg.name)
        return {"error": f"{type(exc).__name__}: {exc}"}
    measured = [(sample, [r for r in recs if r.step == sample.step]) for sample, recs in sink.steps
                if sample.step > warmup]
    return {"n_params": out["n_params"], "times": [sample.step_time_s for sample, _ in measured],
            "comm": [sum(r.duration_s for r in recs) for _, recs in measured],
            "wire": sum(r.wire_bytes for _, recs in measured for r in recs), "tx": tx[1] - tx[0]}


def _rank_main(rank: int, world: int, cfgs: list[BenchConfig], steps: int, warmup: int, model_spec: ModelSpec,
               batch: int) -> list[dict[str, Any]]:
    logging.getLogger("torch").setLevel(logging.ERROR)
    out = []
    for cfg in cfgs:
        out.append(_run_config(rank, cfg, steps, warmup, model_spec, batch))
        if rank == 0:
            sys.stderr.write(f"  {cfg.name}: done\n")
    return out


def summarize(cfg: BenchConfig, link: str, per_rank: list[dict[str, Any]], steps: int, context: int,
              batch: int) -> dict[str, Any]:
    """One output entry (without ``speedup_vs_adamw``) from the ranks' raw timings."""
    entry: dict[str, Any] = {"optimizer": cfg.name, "params": cfg.params, "link": link,
                             "link_bps": parse_rate(link)}
    errors = sorted({r["error"] for r in per_rank if "error" in r})
    if errors:
        entry["error"] = "; ".join(errors)
        return entry
    world = len(per_rank)
    per_step = list(zip(*(r["times"] for r in per_rank), strict=True))
    step_time = statistics.fmean(max(t) for t in per_step)
    comm_time = statistics.fmean(statistics.fmean(r["comm"]) for r in per_rank)
    entry.update(
        step_time_s=round(step_time, 4),
        comm_time_s=round(comm_time, 4),
        tokens_per_s=round(world * batch * context / step_time, 1),
        wire_bytes_per_step=round(statistics.fmean(r["wire"] for r in per_rank) / steps),
        nic_tx_bytes_per_step=round(statistics.fmean(r["tx"] for r in per_rank) / steps),
        model_params=per_rank[0]["n_params"],
        steps=steps,
        world_size=world,
    )
    return entry


def add_speedups(entries: list[dict[str, Any]]) -> None:
    """``speedup_vs_adamw`` of every entry: the baseline's step time at the same link over its own."""
    base = {e["link"]: e["step_time_s"] for e in entries if e["optimizer"] == BASELINE and "step_time_s" in e}
    for e in entries:
        if "step_time_s" in e and e["link"] in base:
            e["speedup_vs_adamw"] = round(base[e["link"]] / e["step_time_s"], 3)


def run(links: tuple[str, ...] = LINKS, steps: int = 24, warmup: int = 2, world: int = 4,
        cfgs: list[BenchConfig] | None = None, model_spec: ModelSpec = MODEL, batch: int = BATCH,
        home: Path | None = None, timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run the benchmark; one entry per (link, optimizer). Raises ``RuntimeError`` where namespaces cannot be made."""
    reason = netns.unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    cfgs = configs() if cfgs is None else cfgs
    home = home or Path(os.environ.get("VIGIL_HOME", ".vigil"))
    entries: list[dict[str, Any]] = []
    netns.cleanup_stale(home)
    with netns.create(home, world, netns.LinkSpec(rate=links[0])) as net:
        names = tuple(n.namespace for n in net.nodes)
        for link in links:
            for n in net.nodes:
                net.shape(n.index, netns.LinkSpec(rate=link))
            sys.stderr.write(f"link {link}: {len(cfgs)} optimizers on {world} ranks in {names[0]}..{names[-1]}\n")
            t0 = time.monotonic()
            results = run_ranks(world, _rank_main, cfgs, steps, warmup, model_spec, batch, timeout=timeout,
                                setup=partial(enter_namespace, names), master_addr=net.nodes[0].address)
            sys.stderr.write(f"link {link}: {time.monotonic() - t0:.0f} s\n")
            entries += [summarize(cfg, link, [results[r][i] for r in range(world)], steps, model_spec.context, batch)
                        for i, cfg in enumerate(cfgs)]
    add_speedups(entries)
    return entries


def table(entries: list[dict[str, Any]]) -> str:
    header = (f"{'optimizer':<18} {'link':>8} {'step s':>8} {'comm s':>8} {'tokens/s':>9} {'speedup':>8} "
              f"{'wire MB/step':>12} {'NIC MB/step':>11}")
    lines = [header]
    for e in entries:
        if "error" in e:
            lines.append(f"{e['optimizer']:<18} {e['link']:>8} error: {e['error']}")
            continue
        lines.append(
            f"{e['optimizer']:<18} {e['link']:>8} {e['step_time_s']:>8.3f} {e['comm_time_s']:>8.3f} "
            f"{e['tokens_per_s']:>9.0f} {e.get('speedup_vs_adamw', float('nan')):>7.2f}x "
            f"{e['wire_bytes_per_step'] / 1e6:>12.2f} {e['nic_tx_bytes_per_step'] / 1e6:>11.2f}"
        )
    return "\n".join(lines)


def markdown(entries: list[dict[str, Any]]) -> str:
    """The speedup table for docs/BENCHMARKS.md: one row per optimizer, one column group per link."""
    links = list(dict.fromkeys(e["link"] for e in entries))
    names = list(dict.fromkeys(e["optimizer"] for e in entries))
    by = {(e["optimizer"], e["link"]): e for e in entries}
    head = "| optimizer | " + " | ".join(f"{lk}: step s / comm s / tokens/s / speedup" for lk in links) + " |"
    rows = [head, "|---|" + "---|" * len(links)]
    for name in names:
        cells = []
        for lk in links:
            e = by.get((name, lk), {})
            cells.append("error" if "step_time_s" not in e else
                         f"{e['step_time_s']:.3f} / {e['comm_time_s']:.3f} / {e['tokens_per_s']:.0f} / "
                         f"**{e.get('speedup_vs_adamw', float('nan')):.2f}x**")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(entries: list[dict[str, Any]], path: Path) -> None:
    """Speedup over DDP AdamW per optimizer, one bar per link (matplotlib, PNG or SVG by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(e["link"] for e in entries))
    names = list(dict.fromkeys(e["optimizer"] for e in entries))
    by = {(e["optimizer"], e["link"]): e.get("speedup_vs_adamw", 0.0) for e in entries}
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(links)
    for j, lk in enumerate(links):
        xs = [i + (j - (len(links) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [by.get((n, lk), 0.0) for n in names], width, label=lk)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(4.0, color="grey", linewidth=0.8, linestyle="--", label="4x")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
    ax.set_ylabel("speedup over DDP AdamW (step time)")
    world = entries[0].get("world_size", "?")
    params = entries[0].get("model_params", 0)
    ax.set_title(f"{world} nodes x 1 rank in network namespaces, {params / 1e6:.1f}M-parameter GPT, same tokens")
    ax.legend(title="link (each way)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vigil bench speedup", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--links", default=",".join(LINKS), help=f"tc rates (default {','.join(LINKS)})")
    parser.add_argument("--steps", type=int, default=24, help="measured steps per optimizer (default 24)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out at the start (default 2)")
    parser.add_argument("--only", default="", help="comma-separated optimizers (default: all; adamw always runs)")
    parser.add_argument("--out", type=Path, help="also write the JSON list to this file")
    parser.add_argument("--from-json", type=Path, help="do not run: read the entries of an earlier --out")
    parser.add_argument("--plot", type=Path, help="also draw the speedups (PNG or SVG, needs matplotlib)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.from_json:
        entries = json.loads(args.from_json.read_text())
        if args.plot:
            plot(entries, args.plot)
        sys.stdout.write((markdown(entries) if args.markdown else table(entries)) + "\n")
        return 0
    links = tuple(x.strip() for x in args.links.split(",") if x.strip())
    try:
        for link in links:
            parse_rate(link)
    except ValueError as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    cfgs = configs()
    if args.only:
        wanted = set(args.only.split(",")) | {BASELINE}
        unknown = wanted - {c.name for c in cfgs}
        if unknown:
            parser.error(f"unknown optimizers {sorted(unknown)}")
        cfgs = [c for c in cfgs if c.name in wanted]
    try:
        entries = run(links, args.steps, args.warmup, cfgs=cfgs)
    except RuntimeError as exc:
        sys.stderr.write(f"vigil bench speedup: {exc}\n")
        return 2
    if args.out:
        args.out.write_text(json.dumps(entries, indent=1) + "\n")
    if args.plot:
        plot(entries, args.plot)
    text = json.dumps(entries, indent=1) if args.json else markdown(entries) if args.markdown else table(entries)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
