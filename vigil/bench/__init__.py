"""Benchmarks: ``python -m vigil.bench <name> [args]`` (the ``vigil bench`` CLI runs these).

* ``comm``: measured payload bits per parameter and step of every optimizer, from the
  communication layer's records, on 4 gloo ranks of this machine (:mod:`vigil.bench.comm`).
* ``kernels``: throughput of the SDP4Bit quantization kernels next to a copy (:mod:`vigil.bench.kernels`).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, str] = {"comm": "vigil.bench.comm", "kernels": "vigil.bench.kernels"}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]`` with the rest of ``argv``; its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        sys.stderr.write(f"usage: python -m vigil.bench {{{','.join(BENCHMARKS)}}} [args]\n")
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)
