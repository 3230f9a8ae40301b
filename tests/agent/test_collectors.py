"""Collectors: NIC and InfiniBand rates from fake /proc and /sys trees, the GPU "unavailable" path,
XID events, host metrics.

Needs: nothing beyond the venv. NIC and IB tests use fake files and a fake clock (this machine has
no HCA: the real /sys gives the "unavailable" answer); the host test reads the real machine
through psutil; the GPU test checks the real NVML answer on this machine (the "unavailable" path
without a GPU) and drives a fake NVML module for the per-device path and XID events.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.collectors import (
    CollectorLoop,
    HostCollector,
    InfinibandCollector,
    NicCollector,
)
from agent.gpu import GpuCollector
from tests.agent.doubles import FakeClock
from vigil.contract.link import parse_proc_net_dev

HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls"
    " carrier compressed\n"
)


def write_net_dev(proc: Path, rows: dict[str, tuple[int, ...]]) -> None:
    """rows: name -> (rx_bytes, rx_packets, rx_errs, rx_drop, tx_bytes, tx_packets, tx_errs, tx_drop)."""
    (proc / "net").mkdir(parents=True, exist_ok=True)
    lines = [HEADER]
    for name, (rb, rp, re_, rd, tb, tp, te, td) in rows.items():
        lines.append(f"{name:>6}: {rb} {rp} {re_} {rd} 0 0 0 0 {tb} {tp} {te} {td} 0 0 0 0\n")
    (proc / "net" / "dev").write_text("".join(lines))


def write_sys(sys_root: Path, name: str, **attrs: str) -> None:
    d = sys_root / "class" / "net" / name
    d.mkdir(parents=True, exist_ok=True)
    for k, v in attrs.items():
        (d / k).write_text(v + "\n")


def test_parse_proc_net_dev_including_glued_numbers():
    text = (
        HEADER
        + "    lo:  100 2 0 0 0 0 0 0  100 2 0 0 0 0 0 0\n  eth0:123456789 10 1 2 0 0 0 0 999 9 3 4 0 0 0 0\n"
    )
    got = parse_proc_net_dev(text)
    assert set(got) == {"lo", "eth0"}
    assert (
        got["eth0"]["rx_bytes"] == 123456789 and got["eth0"]["rx_errs"] == 1 and got["eth0"]["rx_drop"] == 2
    )
    assert got["eth0"]["tx_bytes"] == 999 and got["eth0"]["tx_errs"] == 3 and got["eth0"]["tx_drop"] == 4


def test_parse_real_proc_net_dev():
    got = parse_proc_net_dev(Path("/proc/net/dev").read_text())
    assert "lo" in got and all(v >= 0 for v in got["lo"].values())


def test_nic_rates_come_from_counter_deltas(tmp_path):
    proc, sysr, clock = tmp_path / "proc", tmp_path / "sys", FakeClock(50.0)
    write_sys(sysr, "eth0", operstate="up", speed="10000", carrier_changes="2")
    write_sys(sysr, "veth1", operstate="down", carrier_changes="7")  # no speed file: unreadable
    write_net_dev(
        proc,
        {
            "lo": (5, 5, 0, 0, 5, 5, 0, 0),
            "eth0": (1000, 10, 0, 0, 2000, 20, 0, 0),
            "veth1": (0, 0, 0, 0, 0, 0, 0, 0),
        },
    )
    nic = NicCollector(proc_root=proc, sys_root=sysr, clock=clock)

    first = nic.collect()
    assert first["available"] is True
    assert set(first["interfaces"]) == {"eth0", "veth1"}  # loopback left out by default
    eth0 = first["interfaces"]["eth0"]
    assert eth0["operstate"] == "up" and eth0["speed_mbps"] == 10000 and eth0["carrier_changes"] == 2
    assert eth0["rx_bytes_per_s"] is None and eth0["interval_s"] is None  # no previous reading: no rate
    assert first["interfaces"]["veth1"]["speed_mbps"] is None

    clock.advance(2.0)
    write_net_dev(proc, {"eth0": (5000, 30, 4, 6, 2000, 21, 0, 2), "veth1": (0, 0, 0, 0, 0, 0, 0, 0)})
    second = nic.collect()["interfaces"]["eth0"]
    assert second["interval_s"] == pytest.approx(2.0)
    assert second["rx_bytes_per_s"] == pytest.approx(2000.0)
    assert second["tx_bytes_per_s"] == pytest.approx(0.0)
    assert second["rx_packets_per_s"] == pytest.approx(10.0)
    assert second["tx_packets_per_s"] == pytest.approx(0.5)
    assert second["rx_errors_per_s"] == pytest.approx(2.0)
    assert second["rx_dropped_per_s"] == pytest.approx(3.0)
    assert second["tx_dropped_per_s"] == pytest.approx(1.0)
    assert second["rx_bytes"] == 5000

    # Counters went backwards (interface re-created): no rate is made up.
    clock.advance(1.0)
    write_net_dev(proc, {"eth0": (10, 1, 0, 0, 10, 1, 0, 0)})
    third = nic.collect()["interfaces"]["eth0"]
    assert third["counter_reset"] is True and third["rx_bytes_per_s"] is None
    clock.advance(0.5)
    write_net_dev(proc, {"eth0": (60, 2, 0, 0, 10, 1, 0, 0)})
    assert nic.collect()["interfaces"]["eth0"]["rx_bytes_per_s"] == pytest.approx(100.0)


def test_nic_interface_filter_and_missing_proc(tmp_path):
    proc, sysr = tmp_path / "proc", tmp_path / "sys"
    write_net_dev(proc, {"lo": (1, 1, 0, 0, 1, 1, 0, 0), "eth0": (1, 1, 0, 0, 1, 1, 0, 0)})
    only_lo = NicCollector(proc_root=proc, sys_root=sysr, interfaces=["lo"]).collect()
    assert set(only_lo["interfaces"]) == {"lo"}
    assert only_lo["interfaces"]["lo"]["operstate"] is None  # no /sys entry: None, not an error
    missing = NicCollector(proc_root=tmp_path / "nope", sys_root=sysr).collect()
    assert missing["available"] is False and "net/dev" in missing["reason"]


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return False


def test_gpu_collector_on_this_machine_reports_unavailable_without_gpu():
    got = GpuCollector().collect()
    if _nvml_works():
        assert got["available"] is True and got["count"] >= 1 and got["devices"][0]["memory_total_bytes"] > 0
    else:
        assert got == {"available": False, "reason": got["reason"]}
        assert got["reason"].startswith("NVML unavailable") or got["reason"] == "no GPU on this node"


class FakeNvmlError(Exception):
    pass


class FakeNvmlTimeout(FakeNvmlError):
    pass


class FakeNvml:
    """The subset of pynvml the collector calls."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8
    NVMLError_Timeout = FakeNvmlTimeout

    def __init__(self, count: int = 1, init_error: Exception | None = None, xid_supported: tuple[int, ...] = ()) -> None:
        self.count, self.init_error, self.inits = count, init_error, 0
        self.xid_supported = xid_supported  # devices whose supported event types include XIDs
        self.registered: list[int] = []
        self.pending: list[SimpleNamespace] = []  # events NVML holds
        self.register_error: Exception | None = None

    def nvmlEventSetCreate(self) -> str:
        return "evset"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0b1001 if h in self.xid_supported else 0b0001

    def nvmlDeviceRegisterEvents(self, h: int, types: int, evset: str) -> None:
        if self.register_error is not None:
            raise self.register_error
        assert types == self.nvmlEventTypeXidCriticalError and evset == "evset"
        self.registered.append(h)

    def nvmlEventSetWait_v2(self, evset: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0  # never waits inside a collection
        if not self.pending:
            raise FakeNvmlTimeout("Timeout")
        return self.pending.pop(0)

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def xid(self, device: int, code: int) -> None:
        self.pending.append(SimpleNamespace(device=device, eventType=self.nvmlEventTypeXidCriticalError,
                                            eventData=code))

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"Fake H100"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=10 << 30, total=80 << 30)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 61

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 350_500  # milliwatts

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        raise FakeNvmlError("Not Supported")


def test_gpu_collector_reports_init_failure_as_data_and_retries_later():
    clock = FakeClock()
    nv = FakeNvml(init_error=FakeNvmlError("Driver Not Loaded"))
    gpu = GpuCollector(nvml=nv, clock=clock, retry_s=60)
    got = gpu.collect()
    assert got == {"available": False, "reason": "NVML unavailable: FakeNvmlError: Driver Not Loaded"}
    clock.advance(30)
    assert gpu.collect()["available"] is False and nv.inits == 1  # not retried every heartbeat
    clock.advance(31)
    nv.init_error = None
    assert gpu.collect()["available"] is True and nv.inits == 2


def test_gpu_collector_device_metrics_and_unsupported_fields():
    got = GpuCollector(nvml=FakeNvml(count=2)).collect()
    assert got["available"] is True and got["count"] == 2
    d = got["devices"][1]
    assert d["index"] == 1 and d["name"] == "Fake H100" and d["uuid"] == "GPU-1"
    assert d["util_percent"] == 87 and d["memory_total_bytes"] == 80 << 30
    assert d["power_w"] == pytest.approx(350.5) and d["temperature_c"] == 61
    assert d["ecc_uncorrected_volatile"] is None  # not supported: None, not a failure


def test_gpu_collector_without_devices():
    assert GpuCollector(nvml=FakeNvml(count=0)).collect() == {
        "available": False,
        "reason": "no GPU on this node",
    }


def test_host_collector_real_machine(tmp_path):
    got = HostCollector(disk_paths=["/", tmp_path]).collect()
    assert got["available"] is True
    assert 0.0 <= got["cpu"]["percent"] <= 100.0 and got["cpu"]["count"] >= 1
    assert got["memory"]["total_bytes"] > got["memory"]["available_bytes"] > 0
    assert got["disk"]["/"]["total_bytes"] > 0 and got["disk"][str(tmp_path)]["available"] is True
    assert got["load"]["1m"] >= 0.0


def test_host_collector_degrades_piece_by_piece(tmp_path):
    import psutil

    class BrokenMemory:
        def __getattr__(self, name):
            return getattr(psutil, name)

        def virtual_memory(self):
            raise PermissionError("no /proc/meminfo")

    got = HostCollector(disk_paths=[tmp_path / "missing"], ps=BrokenMemory()).collect()
    assert got["memory"] == {"available": False, "reason": "PermissionError: no /proc/meminfo"}
    assert got["disk"][str(tmp_path / "missing")]["available"] is False
    assert got["cpu"]["available"] is True  # the rest still reported


def test_collector_loop_survives_a_collector_that_raises():
    class Boom:
        name = "boom"

        def collect(self):
            raise RuntimeError("contract broken")

    class Fine:
        name = "fine"

        def collect(self):
            return {"available": True, "x": 1}

    loop = CollectorLoop([Boom(), Fine()], wall_clock=lambda: 123.0)
    assert loop.snapshot() == {}
    snap = loop.step()
    assert snap == loop.snapshot()
    assert snap["ts"] == 123.0 and snap["fine"] == {"available": True, "x": 1}
    assert snap["boom"] == {"available": False, "reason": "RuntimeError: contract broken"}


def test_gpu_xid_events_are_counted_per_device_and_unsupported_ones_say_why():
    nv = FakeNvml(count=2, xid_supported=(0,))
    gpu = GpuCollector(nvml=nv)
    first = gpu.collect()["devices"]
    assert nv.registered == [0]  # only the GPU that supports XID events
    assert (first[0]["xid_errors"], first[0]["last_xid"], first[0]["recent_xids"]) == (0, None, [])
    assert first[1]["xid_errors"] is None and "not supported" in first[1]["xid_reason"]
    nv.xid(0, 79)  # fallen off the bus
    nv.xid(0, 48)  # double-bit ECC
    d0 = gpu.collect()["devices"][0]
    assert (d0["xid_errors"], d0["last_xid"], d0["recent_xids"]) == (2, 48, [79, 48])
    for code in range(20):
        nv.xid(0, code)
    d0 = gpu.collect()["devices"][0]
    assert d0["xid_errors"] == 22 and d0["recent_xids"] == list(range(12, 20))  # the count keeps all
    assert nv.registered == [0]  # registered once, not per collection


def test_gpu_xid_registration_refused_is_data_not_a_failure():
    nv = FakeNvml(count=1, xid_supported=(0,))
    nv.register_error = FakeNvmlError("Insufficient Permissions")
    d = GpuCollector(nvml=nv).collect()["devices"][0]
    assert d["available"] is True and d["util_percent"] == 87  # the rest still reported
    assert d["xid_errors"] is None and "Insufficient Permissions" in d["xid_reason"]


def _ib_port(root: Path, hca: str, port: int, state: str = "4: ACTIVE", rate: str = "100 Gb/sec (4X EDR)",
             **counters: int) -> None:
    d = root / "class" / "infiniband" / hca / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text("5: LinkUp\n")
    (d / "rate").write_text(rate + "\n")
    (d / "link_layer").write_text("InfiniBand\n")
    for k, v in counters.items():
        (d / "counters" / k).write_text(f"{v}\n")


def test_infiniband_port_counters_rates_and_health(tmp_path):
    clock = FakeClock()
    ib = InfinibandCollector(sys_root=tmp_path, clock=clock)
    _ib_port(tmp_path, "mlx5_0", 1, port_xmit_data=1000, port_rcv_data=500, port_xmit_packets=10,
             port_rcv_packets=5, port_rcv_errors=0, symbol_error=0, link_downed=0)
    _ib_port(tmp_path, "mlx5_1", 1, state="1: DOWN", rate="junk")
    first = ib.collect()
    p = first["ports"]["mlx5_0/1"]
    assert first["available"] is True and sorted(first["ports"]) == ["mlx5_0/1", "mlx5_1/1"]
    assert p["tx_bytes"] == 4000 and p["rx_bytes"] == 2000  # 4-byte words
    assert p["operstate"] == "up" and p["ib_state"] == "ACTIVE" and p["speed_mbps"] == 100_000
    assert p["tx_bytes_per_s"] is None and p["interval_s"] is None  # one reading: no rate yet
    down = first["ports"]["mlx5_1/1"]
    assert down["operstate"] == "down" and down["speed_mbps"] is None
    clock.advance(2.0)
    _ib_port(tmp_path, "mlx5_0", 1, port_xmit_data=1000 + 250_000, port_rcv_data=500 + 50, port_xmit_packets=110,
             port_rcv_packets=5, port_rcv_errors=6, symbol_error=3, link_downed=1)
    p = ib.collect()["ports"]["mlx5_0/1"]
    assert p["tx_bytes_per_s"] == 500_000.0 and p["rx_bytes_per_s"] == 100.0  # 4 x words / 2 s
    assert p["tx_packets_per_s"] == 50.0 and p["rx_errors_per_s"] == 3.0
    assert p["symbol_error"] == 3 and p["link_downed"] == 1
    clock.advance(1.0)
    _ib_port(tmp_path, "mlx5_0", 1, port_xmit_data=7, port_rcv_data=7)  # counters reset
    p = ib.collect()["ports"]["mlx5_0/1"]
    assert p["counter_reset"] is True and p["tx_bytes_per_s"] is None


def test_infiniband_absent_is_reported_as_data(tmp_path):
    assert InfinibandCollector(sys_root=tmp_path).collect() == {
        "available": False, "reason": f"no InfiniBand device ({tmp_path}/class/infiniband absent)"}
    real = InfinibandCollector().collect()  # this machine: no HCA (or a real one, with ports)
    assert real["available"] is False or real["ports"]
