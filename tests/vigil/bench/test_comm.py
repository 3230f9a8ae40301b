"""``python -m vigil.bench comm``: measured bits per optimizer.

Needs torch with gloo; the end-to-end cases start 2 gloo ranks on 127.0.0.1 (free port, under a
timeout) and run 2-4 real steps of the benchmark's small GPT.
"""

from __future__ import annotations

import json

import pytest

from vigil.bench import main as bench_main
from vigil.bench.comm import BenchConfig, run, summarize

TIMEOUT = 180


@pytest.mark.timeout(TIMEOUT)
def test_measured_bits_of_two_optimizers() -> None:
    entries = run(steps=4, world=2, configs=[BenchConfig("adamw", "adamw"), BenchConfig("dsm", "dsm", {"tau": 2})],
                  timeout=TIMEOUT)
    adamw, dsm = entries
    assert adamw["payload_bits_per_param_step"] == 32.0
    assert adamw["components"] == {"grads": 32.0}
    assert adamw["wire_bytes_per_step"] == adamw["model_params"] * 4  # ring: 2 (n-1)/n x 4 bytes, n = 2
    # tau = 2 on 2 ranks: reduce-scatter (32) + all-gather of the half (16) every other step
    assert dsm["payload_bits_per_param_step"] == pytest.approx(24.0, abs=1e-3)
    assert dsm["step_time_s"] > 0 and dsm["world_size"] == 2


@pytest.mark.timeout(TIMEOUT)
def test_cli_prints_a_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["comm", "--json", "--only", "cser_pl", "--steps", "8", "--world", "2"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["optimizer"] == "cser_pl" and entry["params"] == {"rc2": 4, "H": 8}
    assert set(entry) >= {"payload_bits_per_param_step", "components", "wire_bytes_per_step", "step_time_s"}
    assert entry["components"]["reset"] == pytest.approx(8.0, rel=0.01)


def test_skipped_and_failed_configurations_are_reported_as_data() -> None:
    cfg = BenchConfig("sdp4bit", "sdp4bit", {"ranks_per_node": 2})
    skipped = summarize(cfg, [{"skipped": "not available (No module named x)"}] * 2, steps=4)
    assert skipped == {"optimizer": "sdp4bit", "params": {"ranks_per_node": 2},
                       "skipped": "not available (No module named x)"}
    ok = {"n_params": 10, "payload_bits": 640, "wire_bytes": 80, "bits": {"g": 640}, "elements": {"g": 20},
          "times": [1.0, 0.1]}
    failed = summarize(cfg, [ok, {"error": "RuntimeError: boom"}], steps=2)
    assert failed["error"] == "RuntimeError: boom"
    good = summarize(cfg, [ok, ok], steps=2)
    assert good["payload_bits_per_param_step"] == 32.0 and good["components"] == {"g": 32.0}
    assert good["step_time_s"] == 0.1  # first step left out


def test_unknown_benchmark_is_a_usage_error() -> None:
    assert bench_main(["nope"]) == 2
