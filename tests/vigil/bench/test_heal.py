"""``vigil bench heal``: Vigil's signed heal transport beside torchft's own on one state; a short run, the JSON's
keys and what they must hold; bad flags refused by name. About 5 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vigil.bench.heal import parse, summarize

ROOT = Path(__file__).resolve().parents[3]


def test_a_short_run_heals_through_both_transports_and_reports_the_ratio() -> None:
    out = subprocess.run([sys.executable, "-m", "vigil.bench.heal", "--mib", "2", "--tensors", "3", "--repeats", "2",
                          "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert (r["state_mib"], r["tensors"], r["repeats"]) == (2.0, 3, 2)
    assert set(r["transports"]) == {"torchft", "signed"}
    for t in r["transports"].values():
        assert len(t["seconds_all"]) == 2 and t["seconds"] == min(t["seconds_all"]) > 0
        assert t["mib_per_s"] == pytest.approx(2.0 / t["seconds"], rel=0.03)  # seconds are rounded to 0.1 ms
    assert r["ratio"] == pytest.approx(r["transports"]["signed"]["seconds"] / r["transports"]["torchft"]["seconds"], rel=0.05)


def test_the_fastest_heal_of_each_way_is_kept() -> None:
    out = summarize({"torchft": [0.4, 0.2], "signed": [0.5, 0.3]}, mib=10.0)
    assert out["transports"]["torchft"] == {"seconds": 0.2, "seconds_all": [0.4, 0.2], "mib_per_s": 50.0}
    assert out["ratio"] == 1.5
    assert "ratio" not in summarize({"signed": [0.5]}, mib=1.0)  # no baseline in the run: no ratio


@pytest.mark.parametrize(("argv", "field"), [(["--mib", "0"], "--mib"), (["--repeats", "0"], "--repeats"),
                                             (["--tensors", "0"], "--tensors")])
def test_bad_flags_are_refused_by_name(argv: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and field in capsys.readouterr().err
