"""The agent's GPU collector (agent/gpu.py) against the real NVML of a GPU machine, idle and under load.

Needs: an NVIDIA GPU with its driver and ``nvidia-ml-py`` (skipped without, with that reason; CI's machine
has none, so this runs on a lent GPU: tests/device/check_gpu.sh), and torch with CUDA for the load. The
fake-NVML tests of the same collector are in tests/agent/test_collectors.py; this one checks that what
the real library answers lands in the fields the heartbeat sends, with sane values.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent.gpu import GpuCollector


def _nvml_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return 0


pytestmark = pytest.mark.skipif(_nvml_gpus() == 0, reason="needs an NVIDIA GPU with NVML (none on this machine)")
GIB = 1 << 30


def _check_device(d: dict[str, Any]) -> None:
    assert d["available"] is True and "NVIDIA" in d["name"] and d["uuid"].startswith("GPU-"), d
    assert 0 <= d["util_percent"] <= 100 and 0 <= d["mem_util_percent"] <= 100, d
    assert 0 < d["memory_used_bytes"] <= d["memory_total_bytes"], d
    assert d["memory_total_bytes"] > 16 * GIB, d  # an H100 or H200: 80 or 141 GB
    assert 10 <= d["temperature_c"] <= 95, d  # degrees C, a running GPU's
    assert d["power_w"] is None or 10.0 < d["power_w"] < 1500.0, d  # watts, not milliwatts
    assert d["ecc_uncorrected_volatile"] is None or d["ecc_uncorrected_volatile"] >= 0, d
    # XID events registered (count since start, none here), or the reason they could not be
    assert (d["xid_errors"] == 0 and d["recent_xids"] == []) or isinstance(d.get("xid_reason"), str), d


def test_real_nvml_reports_every_gpu_with_sane_values() -> None:
    gpu = GpuCollector()
    got = gpu.collect()
    assert got["available"] is True and got["count"] == _nvml_gpus() == len(got["devices"]), got
    for i, d in enumerate(got["devices"]):
        assert d["index"] == i
        _check_device(d)
    again = gpu.collect()  # the second collection drains XID events without registering again
    assert again["available"] is True and [d["uuid"] for d in again["devices"]] == [d["uuid"] for d in got["devices"]]


def test_real_nvml_sees_memory_and_work_that_torch_puts_on_the_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA to put load on the GPU")
    gpu = GpuCollector()
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)

    def mine() -> dict[str, Any]:
        """torch's cuda:0 among NVML's devices (by UUID; the only one where there is one)."""
        devices = gpu.collect()["devices"]
        found = [d for d in devices if d.get("uuid") == uuid] or (devices if len(devices) == 1 else [])
        assert found, (uuid, [d.get("uuid") for d in devices])
        return found[0]

    before = mine()
    block = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # NVML's utilisation covers the last second or so
        for _ in range(20):
            a = (a @ a).clamp_(-1.0, 1.0)
        torch.cuda.synchronize()
    during = mine()
    del block, a
    _check_device(during)
    assert during["memory_used_bytes"] >= before["memory_used_bytes"] + 4 * GIB - (256 << 20), (before, during)
    assert during["util_percent"] > 0, during
