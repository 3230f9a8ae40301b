"""``vigil bench speedup`` on a small model: 4 ranks in 4 namespaces, two link speeds, two optimizers.

Checks the output keys, that the baseline's speedup is 1, that the step time of DDP AdamW at the
slow link is at least what its bytes need at that rate, that the NIC counted what the communication
layer reported, and that fp16 compression halves the bytes and is faster at the slow link (its communication at least a quarter shorter).

Needs: root, iproute2 (``ip``, ``tc``); skipped otherwise with the reason. About a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops import netns
from vigil.bench import speedup
from vigil.bench.comm import BenchConfig
from vigil.contract.schemas import ModelSpec

pytestmark = [pytest.mark.links,
              pytest.mark.skipif(netns.unavailable_reason() is not None, reason=netns.unavailable_reason() or ""),
              pytest.mark.timeout(600)]

KEYS = {"optimizer", "link", "step_time_s", "comm_time_s", "tokens_per_s", "speedup_vs_adamw"}


def test_speedup_small(tmp_path: Path) -> None:
    model = ModelSpec.model_validate({"n_layer": 2, "n_head": 2, "d_model": 128, "context": 16})
    cfgs = [BenchConfig("adamw", "adamw"), BenchConfig("fp16_compress", "fp16_compress")]
    entries = speedup.run(("200mbit", "50mbit"), steps=3, warmup=1, cfgs=cfgs, model_spec=model, batch=1,
                          home=tmp_path, timeout=400)
    assert [(e["optimizer"], e["link"]) for e in entries] == [
        ("adamw", "200mbit"), ("fp16_compress", "200mbit"), ("adamw", "50mbit"), ("fp16_compress", "50mbit")]
    by = {(e["optimizer"], e["link"]): e for e in entries}
    for e in entries:
        assert KEYS <= set(e), e
        # Counted over the measured steps: a last send may still sit in the queue when the counter is read.
        assert 0.97 * e["wire_bytes_per_step"] <= e["nic_tx_bytes_per_step"] <= 1.1 * e["wire_bytes_per_step"] + 65536, e
    base = by[("adamw", "50mbit")]
    assert base["speedup_vs_adamw"] == 1.0
    assert base["step_time_s"] >= 0.9 * base["wire_bytes_per_step"] * 8 / 50e6
    half = by[("fp16_compress", "50mbit")]
    assert half["wire_bytes_per_step"] == pytest.approx(base["wire_bytes_per_step"] / 2, rel=0.02)
    assert half["speedup_vs_adamw"] > 1.0  # half the bytes: faster, by how much depends on the compute
    assert half["comm_time_s"] < 0.75 * base["comm_time_s"]
    assert base["step_time_s"] > by[("adamw", "200mbit")]["step_time_s"]
    assert speedup.markdown(entries).count("\n") == 3  # header, rule, two optimizers
    assert not netns.leftovers({"nodes": [], "bridge": None}) and netns.cleanup_stale(tmp_path) == 0
