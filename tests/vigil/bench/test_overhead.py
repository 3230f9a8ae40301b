"""``vigil bench overhead --mode captured``: the plain DDP example on 2 gloo ranks beside a real agent, the
Flight Recorder's capture on and off in blocks; a short run, the JSON's keys and what they must hold.

Needs: 2 gloo ranks on this machine and the `agent` module (a real agent process). About 20 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_captured_mode_reports_the_capture_cpu_beside_the_ratio() -> None:
    out = subprocess.run([sys.executable, "-m", "vigil.bench.overhead", "--mode", "captured", "--steps", "60",
                          "--block", "5", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["mode"] == "captured" and r["steps"] == 60 and r["block_pairs"] >= 4
    # one DDP bucket a step: every step's all-reduce is read (plus the start-up broadcasts)
    assert r["collectives_captured"] >= 60 and r["recorder_reads"] >= 1
    assert r["capture_cpu_us_per_step"] > 0 and r["capture_cpu_us_per_collective"] > 0
    assert r["samples_dropped"] == 0 and r["ratio"] > 0
