"""`vigil bench kernels --json`: every kernel is timed next to a copy of the same bytes, with the keys
the optimizers issue names (``kernel``, ``numel``, ``gbps``, ``copy_gbps``, ``ratio_to_copy``).

Needs: torch only; a tiny eager run in a subprocess, as the CLI makes it (no compile: seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys

KERNELS = {"quantize4", "quantize8", "quantize4_w2048", "dequantize4", "dequantize8", "pack4", "unpack4",
           "hadamard32", "inverse_hadamard32", "hash_noise", "torch_rand"}


def test_kernels_json_has_every_kernel_beside_its_copy() -> None:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "kernels", "--json", "--sizes", "64K",
                        "--reps", "1", "--no-compile"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["meta"]["device"] == "cpu" and report["meta"]["compiled_available"] is False
    rows = report["results"]
    assert {row["kernel"] for row in rows} == KERNELS
    for row in rows:
        assert row["numel"] == 64 * 1024 and row["mode"] == "eager", row
        assert row["gbps"] > 0 and row["copy_gbps"] > 0, row
        # the ratio is the two rates' quotient, as measured in this run (rounded to 4 places)
        assert abs(row["ratio_to_copy"] - row["gbps"] / row["copy_gbps"]) < 1e-3 + 1e-3 * row["ratio_to_copy"], row
