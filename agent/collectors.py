"""Node metrics for the heartbeat: host (psutil), NICs (/proc and /sys), GPUs (NVML).

Every collector returns plain JSON-able data and never raises: what it cannot read it reports as
``{"available": False, "reason": ...}`` (no GPU, no NVML, an interface without a speed, ...).
The clock and the ``/proc`` and ``/sys`` roots are parameters, so tests drive rates from fake
counter files and a fake clock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import psutil

log = logging.getLogger(__name__)

Metrics = dict[str, Any]


def unavailable(reason: str) -> Metrics:
    """What a probe reports when it cannot measure."""
    return {"available": False, "reason": reason}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Collector(Protocol):
    """One source of node metrics. ``collect`` must not raise."""

    name: str

    def collect(self) -> Metrics: ...


# --------------------------------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------------------------------


class HostCollector:
    """CPU, memory, disk usage and load average through psutil."""

    name = "system"

    def __init__(
        self,
        disk_paths: Sequence[str | Path] = ("/",),
        ps: Any = psutil,
        loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
    ) -> None:
        self._disk_paths = [str(p) for p in disk_paths]
        self._ps = ps
        self._loadavg = loadavg
        # The first non-blocking call only starts the measurement window (it returns 0.0); if it
        # fails, collect() reports why.
        with contextlib.suppress(Exception):
            self._ps.cpu_percent(interval=None)

    def collect(self) -> Metrics:
        return {
            "available": True,
            "cpu": self._probe(self._cpu),
            "memory": self._probe(self._memory),
            "disk": {p: self._probe_disk(p) for p in self._disk_paths},
            "load": self._probe(self._load),
        }

    def _probe_disk(self, path: str) -> Metrics:
        return self._probe(lambda: self._disk(path))

    @staticmethod
    def _probe(fn: Callable[[], Metrics]) -> Metrics:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a probe reports failure as data (CONVENTIONS 7)
            return unavailable(_describe(exc))

    def _cpu(self) -> Metrics:
        return {
            "available": True,
            "percent": float(self._ps.cpu_percent(interval=None)),
            "count": self._ps.cpu_count(),
        }

    def _memory(self) -> Metrics:
        vm = self._ps.virtual_memory()
        sw = self._ps.swap_memory()
        return {
            "available": True,
            "total_bytes": int(vm.total),
            "available_bytes": int(vm.available),
            "used_bytes": int(vm.used),
            "percent": float(vm.percent),
            "swap_used_bytes": int(sw.used),
            "swap_percent": float(sw.percent),
        }

    def _disk(self, path: str) -> Metrics:
        du = self._ps.disk_usage(path)
        return {
            "available": True,
            "total_bytes": int(du.total),
            "used_bytes": int(du.used),
            "free_bytes": int(du.free),
            "percent": float(du.percent),
        }

    def _load(self) -> Metrics:
        one, five, fifteen = self._loadavg()
        return {"available": True, "1m": one, "5m": five, "15m": fifteen}


# --------------------------------------------------------------------------------------------------
# NICs
# --------------------------------------------------------------------------------------------------

_RX_FIELDS = ("bytes", "packets", "errs", "drop", "fifo", "frame", "compressed", "multicast")
_TX_FIELDS = ("bytes", "packets", "errs", "drop", "fifo", "colls", "carrier", "compressed")
#: Counters turned into per-second rates, and the names they are reported under.
_RATED = {
    "rx_bytes": "rx_bytes_per_s",
    "tx_bytes": "tx_bytes_per_s",
    "rx_packets": "rx_packets_per_s",
    "tx_packets": "tx_packets_per_s",
    "rx_errs": "rx_errors_per_s",
    "tx_errs": "tx_errors_per_s",
    "rx_drop": "rx_dropped_per_s",
    "tx_drop": "tx_dropped_per_s",
}


def parse_proc_net_dev(text: str) -> dict[str, dict[str, int]]:
    """Counters per interface from the text of ``/proc/net/dev`` (``rx_bytes``, ``tx_errs``, ...)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or "|" in line:  # the two header lines
            continue
        values = rest.split()
        if len(values) < len(_RX_FIELDS) + len(_TX_FIELDS):
            continue
        try:
            numbers = [int(v) for v in values]
        except ValueError:
            continue
        counters = {f"rx_{f}": v for f, v in zip(_RX_FIELDS, numbers[:8])}
        counters.update({f"tx_{f}": v for f, v in zip(_TX_FIELDS, numbers[8:16])})
        out[name.strip()] = counters
    return out


class NicCollector:
    """Per-interface counters, link state and rates computed from counter deltas.

    Rates are ``None`` on the first reading and after a counter went backwards (interface
    re-created or counter reset): never guessed.
    """

    name = "nics"

    def __init__(
        self,
        proc_root: str | Path = "/proc",
        sys_root: str | Path = "/sys",
        clock: Callable[[], float] = time.monotonic,
        interfaces: Iterable[str] | None = None,
        include_loopback: bool = False,
    ) -> None:
        self._proc_net_dev = Path(proc_root) / "net" / "dev"
        self._sys_net = Path(sys_root) / "class" / "net"
        self._clock = clock
        self._only = set(interfaces) if interfaces is not None else None
        self._include_lo = include_loopback
        self._prev: dict[str, tuple[float, dict[str, int]]] = {}

    def collect(self) -> Metrics:
        try:
            text = self._proc_net_dev.read_text()
        except OSError as exc:
            return unavailable(f"cannot read {self._proc_net_dev}: {_describe(exc)}")
        now = self._clock()
        counters = parse_proc_net_dev(text)
        interfaces: dict[str, Metrics] = {}
        for name, cur in counters.items():
            if self._only is not None and name not in self._only:
                continue
            if self._only is None and name == "lo" and not self._include_lo:
                continue
            interfaces[name] = self._interface(name, cur, now)
        # Forget interfaces that vanished, so a re-created one starts fresh.
        self._prev = {k: v for k, v in self._prev.items() if k in interfaces}
        return {"available": True, "interfaces": interfaces}

    def _interface(self, name: str, cur: dict[str, int], now: float) -> Metrics:
        m: Metrics = dict(cur)
        m["operstate"] = self._read_sys(name, "operstate")
        speed = self._read_int(name, "speed")
        m["speed_mbps"] = speed if speed is not None and speed >= 0 else None
        m["carrier_changes"] = self._read_int(name, "carrier_changes")
        prev = self._prev.get(name)
        dt = now - prev[0] if prev is not None else None
        reset = prev is not None and any(cur[k] < prev[1].get(k, 0) for k in _RATED)
        if prev is None or dt is None or dt <= 0 or reset:
            m["interval_s"] = None
            for rate in _RATED.values():
                m[rate] = None
            if reset:
                m["counter_reset"] = True
        else:
            m["interval_s"] = dt
            for counter, rate in _RATED.items():
                m[rate] = (cur[counter] - prev[1][counter]) / dt
        self._prev[name] = (now, cur)
        return m

    def _read_sys(self, name: str, attr: str) -> str | None:
        try:
            return (self._sys_net / name / attr).read_text().strip()
        except OSError:  # virtual or down interfaces refuse some attributes (EINVAL)
            return None

    def _read_int(self, name: str, attr: str) -> int | None:
        raw = self._read_sys(name, attr)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None


# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------


def _load_pynvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; imported lazily so a node without it still runs

    return pynvml


class GpuCollector:
    """Per-GPU utilisation, memory, temperature, power and ECC errors through NVML.

    ``nvml`` is the pynvml module or a fake with the same functions. When NVML cannot start (no
    driver, no GPU) the collector reports why, and tries again at most every ``retry_s``.
    """

    name = "gpus"

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = 60.0,
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._retry_s = retry_s
        self._ready = False
        self._failure: str | None = None
        self._failed_at = float("-inf")

    def _init(self) -> str | None:
        """Start NVML if needed; the reason it is unavailable, or None."""
        if self._ready:
            return None
        if self._failure is not None and self._clock() - self._failed_at < self._retry_s:
            return self._failure
        try:
            if self._nvml is None:
                self._nvml = _load_pynvml()
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_*, OSError: all mean "no NVML"
            self._failure = f"NVML unavailable: {_describe(exc)}"
            self._failed_at = self._clock()
            return self._failure
        self._ready = True
        self._failure = None
        return None

    def collect(self) -> Metrics:
        reason = self._init()
        if reason is not None:
            return unavailable(reason)
        nv: Any = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - reported as data
            return unavailable(f"nvmlDeviceGetCount failed: {_describe(exc)}")
        if count == 0:
            return unavailable("no GPU on this node")
        devices = []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # noqa: BLE001 - a lost GPU is reported, not raised
                devices.append({"index": i, **unavailable(_describe(exc))})
                continue
            devices.append({"index": i, "available": True, **self._device(h)})
        return {"available": True, "count": count, "devices": devices}

    def _device(self, h: Any) -> Metrics:
        nv: Any = self._nvml
        m: Metrics = {}

        def probe(key: str, fn: Callable[[], Any]) -> None:
            # A metric the GPU does not support (NVMLError_NotSupported) is None, not an error.
            try:
                m[key] = fn()
            except Exception:  # noqa: BLE001
                m[key] = None

        probe("name", lambda: _text(nv.nvmlDeviceGetName(h)))
        probe("uuid", lambda: _text(nv.nvmlDeviceGetUUID(h)))
        probe("util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        probe("mem_util_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).memory)
        probe("memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used)
        probe("memory_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total)
        probe("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        probe("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        probe(
            "ecc_uncorrected_volatile",
            lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
        )
        return m


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


# --------------------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------------------


class CollectorLoop:
    """Runs the collectors periodically in their own thread and keeps the latest snapshot.

    The heartbeat reads :meth:`snapshot` and never waits for a probe, so a hung driver call
    delays the metrics, not the heartbeat (heartbeat loss means "node dead" to the controller).
    """

    def __init__(
        self,
        collectors: Sequence[Collector],
        interval_s: float = 1.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._collectors = list(collectors)
        self._interval = interval_s
        self._wall_clock = wall_clock
        self._latest: Metrics = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> Metrics:
        """Collect once from every collector and store the snapshot."""
        snap: Metrics = {"ts": self._wall_clock()}
        for c in self._collectors:
            try:
                snap[c.name] = c.collect()
            except Exception as exc:  # noqa: BLE001 - a collector breaking its contract must not stop us
                log.warning("collector %s failed: %s", c.name, _describe(exc))
                snap[c.name] = unavailable(_describe(exc))
        with self._lock:
            self._latest = snap
        return snap

    def snapshot(self) -> Metrics:
        with self._lock:
            return dict(self._latest)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="vigil-agent-collectors", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self._interval)
