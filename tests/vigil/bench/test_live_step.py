"""``vigil bench live-step``: the live replica's step beside a plain gloo all-reduce on 2 processes (a lighthouse,
two torchft managers); a short run, the JSON's keys and what they must hold; bad flags refused by name.

About 15 s (four processes started, each importing torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vigil.bench.live_step import parse, summarize

ROOT = Path(__file__).resolve().parents[3]


def test_a_short_run_reports_each_variant_and_its_overhead_over_gloo() -> None:
    out = subprocess.run([sys.executable, "-m", "vigil.bench.live_step", "--steps", "40", "--repeats", "1",
                          "--elements", "1000", "--variants", "gloo,live", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert (r["steps"], r["elements"], r["repeats"]) == (40, 1000, 1)
    assert set(r["variants"]) == {"gloo", "live"}
    for v in r["variants"].values():
        assert 0 < v["median_ms"] and 0 < v["mean_ms"] and v["means_ms"] == [v["mean_ms"]]
    live, gloo = r["variants"]["live"]["mean_ms"], r["variants"]["gloo"]["mean_ms"]
    assert r["overhead_ms"] == {"live": round(live - gloo, 3)} and r["ratio"] == {"live": round(live / gloo, 3)}


def test_the_fastest_run_of_each_variant_is_kept() -> None:
    runs = {"gloo": [{"mean_ms": 4.0, "median_ms": 3.0}, {"mean_ms": 2.0, "median_ms": 2.5}],
            "live": [{"mean_ms": 3.0, "median_ms": 2.9}]}
    out = summarize(runs)
    assert out["variants"]["gloo"] == {"mean_ms": 2.0, "median_ms": 2.5, "means_ms": [4.0, 2.0]}
    assert out["overhead_ms"] == {"live": 1.0} and out["ratio"] == {"live": 1.5}
    assert "ratio" not in summarize({"live": runs["live"]})  # no baseline in the run: no ratio


@pytest.mark.parametrize(("argv", "says"), [(["--variants", "gloo,nccl"], "--variants: unknown ['nccl']"),
                                            (["--steps", "20"], "--steps: must be more than the 20 warm-up"),
                                            (["--repeats", "0"], "--repeats: must be at least 1")])
def test_bad_flags_are_refused_by_name(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
