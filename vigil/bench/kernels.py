"""Throughput of the SDP4Bit quantization kernels next to a plain tensor copy of the same bytes.

``python -m vigil.bench.kernels [--json] [--sizes 1M,4M,16M] [--threads 1] [--no-compile]``

For each size and kernel the copy of a tensor of the same byte size is timed in the same run,
just before the kernel, so a busy machine slows both alike. The copy is ``clone()``: like every
kernel here it allocates its output, and on CPU a fresh large allocation costs page faults
(glibc returns big blocks to the OS on free) that a copy into a preallocated tensor does not pay;
that in-place copy is reported beside it as ``copy_inplace_gbps``. Timings are the best of ``--reps``
runs after a warm-up (the least-disturbed run on a shared host). Bytes per kernel:

* quantize / dequantize / Hadamard / noise: the fp32 size of the data, ``4 * numel`` (quantize
  reads that much; dequantize writes it), so GB/s compare directly with the fp32 copy;
* pack4 / unpack4: the int8 values, ``numel`` bytes.

Kernels run eager, and (unless ``--no-compile``) again with ``torch.compile``-fused quantize /
dequantize (``mode`` says which; pack, unpack and Hadamard are the same code in both modes and
are measured once). ``torch.rand`` of the same count is listed for reference: the noise of a
stochastic quantizer is what makes it slow in eager mode.

JSON (``--json``): ``{"meta": {...}, "results": [{"kernel", "mode", "numel", "bytes", "seconds",
"gbps", "copy_gbps", "ratio_to_copy", "copy_inplace_gbps"}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from vigil import quant

log = logging.getLogger(__name__)


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _best_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up (first-touch allocation, compilation for this shape)
    _sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_times(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """Best times of ``src.clone()`` (allocates its output, as every kernel here does) and of
    ``dst.copy_(src)`` into a preallocated tensor, for ``nbytes`` bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_time(src.clone, reps), _best_time(lambda: dst.copy_(src), reps)


def _kernels(numel: int, device: torch.device) -> list[tuple[str, int, Callable[[], Any], bool]]:
    """(name, bytes, fn, depends_on_mode) for one size."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(numel, generator=g).to(device)
    key = quant.stream_key(0, 1)
    q4, s4 = quant.quantize(x, 4, 128, key, pack=False)
    p4 = quant.pack4(q4)
    q8, s8 = quant.quantize(x, 8, 128, key)
    fp32 = 4 * numel
    return [
        ("quantize4", fp32, lambda: quant.quantize(x, 4, 128, key), True),
        ("quantize8", fp32, lambda: quant.quantize(x, 8, 128, key), True),
        ("quantize4_w2048", fp32, lambda: quant.quantize(x, 4, 2048, key), True),
        ("dequantize4", fp32, lambda: quant.dequantize(p4, s4, 128, packed=True), True),
        ("dequantize8", fp32, lambda: quant.dequantize(q8, s8, 128), True),
        ("pack4", numel, lambda: quant.pack4(q4), False),
        ("unpack4", numel, lambda: quant.unpack4(p4), False),
        ("hadamard32", fp32, lambda: quant.hadamard(x, 32), False),
        ("inverse_hadamard32", fp32, lambda: quant.inverse_hadamard(x, 32), False),
        ("hash_noise", fp32, lambda: quant.uniform_noise(numel, key, device), False),
        ("torch_rand", fp32, lambda: torch.rand(numel, device=device), False),
    ]


def run(sizes: list[int], *, reps: int = 5, compile_too: bool = True, device: str = "cpu") -> dict[str, Any]:
    dev = torch.device(device)
    modes = ["eager"]
    if compile_too:
        modes.append("compiled" if quant.set_compiled(True) else "compile_failed")
        quant.set_compiled(False)
    results: list[dict[str, Any]] = []
    for numel in sizes:
        kernels = _kernels(numel, dev)
        for mode in modes:
            if mode == "compile_failed":
                continue
            quant.set_compiled(mode == "compiled")
            for name, nbytes, fn, per_mode in kernels:
                if mode != "eager" and not per_mode:
                    continue
                copy_s, inplace_s = _copy_times(nbytes, dev, reps)
                sec = _best_time(fn, reps)
                gbps, copy_gbps = nbytes / sec / 1e9, nbytes / copy_s / 1e9
                results.append({
                    "kernel": name, "mode": mode, "numel": numel, "bytes": nbytes, "seconds": sec,
                    "gbps": round(gbps, 3), "copy_gbps": round(copy_gbps, 3),
                    "ratio_to_copy": round(gbps / copy_gbps, 4),
                    "copy_inplace_gbps": round(nbytes / inplace_s / 1e9, 3),
                })
                log.info("%s %s %d: %.3f GB/s (copy %.3f)", name, mode, numel, gbps, copy_gbps)
    quant.set_compiled(False)
    meta = {
        "torch": torch.__version__, "device": device, "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
        "reps": reps, "compiled_available": "compiled" in modes,
    }
    return {"meta": meta, "results": results}


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'kernel':<20}{'mode':<10}{'numel':>10}{'GB/s':>9}{'copy GB/s':>11}{'x copy':>9}"]
    for r in report["results"]:
        lines.append(f"{r['kernel']:<20}{r['mode']:<10}{r['numel']:>10}{r['gbps']:>9.3f}"
                     f"{r['copy_gbps']:>11.3f}{r['ratio_to_copy']:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vigil.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--sizes", default="1M,4M,16M", help="comma-separated element counts (K/M/G suffixes)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per kernel (best is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd kernels")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(n <= 0 or n % 2048 for n in sizes):
        ap.error("sizes must be positive multiples of 2048")
    report = run(sizes, reps=args.reps, compile_too=not args.no_compile, device=args.device)
    sys.stdout.write((json.dumps(report, indent=1) if args.json else _table(report)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
