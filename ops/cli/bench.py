"""``vigil bench NAME ...``: each benchmark runs as its own process, ``python -m MODULE ...``, so the
trainer's benchmarks stay out of the controller's imports."""

from __future__ import annotations

import argparse
import subprocess
import sys

BENCHMARKS = {
    "comm": "vigil.bench.comm",
    "kernels": "vigil.bench.kernels",
    "convergence": "vigil.bench.convergence",
    "overhead": "vigil.bench.overhead",
    "speedup": "vigil.bench.speedup",
    "live-step": "vigil.bench.live_step",
    "heal": "vigil.bench.heal",
    "ingest": "ops.bench.ingest",
    "recovery": "ops.bench.recovery",
    "stragglers": "ops.bench.stragglers",
    "adapt": "ops.bench.adapt",
    "chaos": "ops.bench.chaos",
    "dashboard": "ops.bench.dashboard",
    "security": "ops.bench.security",
    "footprint": "ops.bench.footprint",
    "http": "ops.bench.http_latency",
}
"""What ``vigil bench NAME`` runs: NAME -> the module run with ``python -m``."""


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    # The controller never imports the trainer: benchmarks of trainer code run as their own process.
    module = BENCHMARKS.get(args.what)
    if module is None:
        print(f"bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", module, *rest])


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``bench`` on ``sub``; its own flags pass through to the benchmark."""
    b = sub.add_parser("bench", help="Benchmarks (comm, kernels, convergence, overhead, live-step, heal, ingest, recovery, stragglers, adapt, chaos, speedup, dashboard, security, footprint, http).",
                       add_help=False)
    b.add_argument("what")
