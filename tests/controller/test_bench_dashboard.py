"""``vigil bench dashboard`` at a tiny size: a real controller fed through ingest, a real Chromium, and
the JSON keys the issue names (the figures themselves are in docs/BENCHMARKS.md, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench.dashboard import CHROMEDRIVER, CHROMIUM, _tick_entries

KEYS = {"ranks", "steps", "server_s_per_refresh", "bytes_per_refresh", "browser_draw_s"}


def test_tick_entries_take_the_first_refresh_after_the_mark() -> None:
    entries = [{"start": 10.0}, {"start": 1000.0}, {"start": 1200.0}, {"start": 3100.0}]
    assert _tick_entries(entries, since_ms=500.0) == [{"start": 1000.0}, {"start": 1200.0}]
    assert _tick_entries(entries, since_ms=5000.0) == []


@pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                    reason="needs Debian's chromium and chromium-driver (make browser installs them)")
def test_bench_dashboard_json_at_a_tiny_size() -> None:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "dashboard", "--json", "--ranks", "12",
                        "--steps", "8", "--ticks", "1"], capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert [row["ranks"] for row in rows] == [12]
    for row in rows:
        assert KEYS <= set(row)
        assert row["steps"] == 8 and row["samples"] == row["ranks"] * 2 * 8
        assert row["page_errors"] == 0 and row["stale_refreshes"] == 0  # each refresh drew the new step
        assert 0 < row["bytes_per_refresh"] < row["first_load_bytes"]  # incremental: less than the first load
        assert row["server_s_per_refresh"] > 0 and row["browser_draw_s"] >= 0
