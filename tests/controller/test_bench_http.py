"""``vigil bench http`` at a tiny size: both variants served by the real controller app, JSON as documented."""

from __future__ import annotations

import json

import pytest

from ops.bench import http_latency
from ops.cli.bench import BENCHMARKS


def test_bench_http_json_names_both_variants_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["http"] == "ops.bench.http_latency"
    assert http_latency.main(["--requests", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["path"] == "/api/v1/jobs" and out["listening_socket_proto"] == 0
    for name in ("plain", "vigil"):
        r = out[name]
        assert set(r) == {"first_ms", "p50_ms", "p99_ms"}
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
    assert out["p50_ratio"] == round(out["plain"]["p50_ms"] / out["vigil"]["p50_ms"], 1)


def test_bench_http_refuses_no_requests(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        http_latency.main(["--requests", "0"])
    assert e.value.code == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
