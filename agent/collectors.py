"""Node metrics for the heartbeat: host (psutil), NICs (/proc and /sys), InfiniBand ports (/sys),
GPUs (NVML, with XID error events).

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

from controller.background import BackgroundLoop
from controller.link import parse_proc_net_dev

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
# InfiniBand
# --------------------------------------------------------------------------------------------------

#: IB port counters that count 4-byte words, not bytes (the IBA spec's PortXmitData / PortRcvData).
_IB_WORDS = {"port_xmit_data": "tx_bytes", "port_rcv_data": "rx_bytes"}
#: IB port counters under the names the NIC collector uses, so both read alike downstream.
_IB_AS_NIC = {
    "port_xmit_packets": "tx_packets",
    "port_rcv_packets": "rx_packets",
    "port_rcv_errors": "rx_errs",
    "port_xmit_discards": "tx_drop",
    "port_rcv_remote_physical_errors": "rx_remote_physical_errs",
}
#: Link-health counters of an IB port (errors a sick cable or switch port shows first).
_IB_HEALTH = ("symbol_error", "link_downed", "link_error_recovery", "local_link_integrity_errors",
              "excessive_buffer_overrun_errors", "port_xmit_constraint_errors", "port_rcv_constraint_errors")


def _parse_ib_rate_mbps(text: str | None) -> int | None:
    """``"100 Gb/sec (4X EDR)"`` -> 100000; None when unreadable."""
    if not text:
        return None
    head = text.split()
    try:
        value = float(head[0])
    except (IndexError, ValueError):
        return None
    unit = head[1].lower() if len(head) > 1 else "gb/sec"
    return int(value * (1000 if unit.startswith("gb") else 1))


class InfinibandCollector:
    """Per-port counters of InfiniBand / RoCE HCAs from ``/sys/class/infiniband``, with rates.

    Each port (``mlx5_0/1``) is reported in the NIC collector's shape (``rx_bytes``, ``tx_packets``,
    ``rx_errs``, ``operstate``, ``speed_mbps``, ``*_per_s`` rates from counter deltas, None on the
    first reading and after a reset), plus the link-health counters (``symbol_error``,
    ``link_downed``, ...). ``port_xmit_data`` / ``port_rcv_data`` count 4-byte words: bytes are 4x.
    A node without an HCA reports ``unavailable`` as data.
    """

    name = "infiniband"

    def __init__(self, sys_root: str | Path = "/sys", clock: Callable[[], float] = time.monotonic) -> None:
        self._root = Path(sys_root) / "class" / "infiniband"
        self._clock = clock
        self._prev: dict[str, tuple[float, dict[str, int]]] = {}

    def collect(self) -> Metrics:
        try:
            hcas = sorted(p for p in self._root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return unavailable(f"no InfiniBand device ({self._root} absent)")
        except OSError as exc:
            return unavailable(f"cannot read {self._root}: {_describe(exc)}")
        now = self._clock()
        ports: dict[str, Metrics] = {}
        for hca in hcas:
            try:
                port_dirs = sorted((hca / "ports").iterdir(), key=lambda p: p.name)
            except OSError:
                continue
            for port in port_dirs:
                ports[f"{hca.name}/{port.name}"] = self._port(f"{hca.name}/{port.name}", port, now)
        self._prev = {k: v for k, v in self._prev.items() if k in ports}
        if not ports:
            return unavailable(f"no InfiniBand port under {self._root}")
        return {"available": True, "ports": ports}

    def _port(self, key: str, port: Path, now: float) -> Metrics:
        raw: dict[str, int] = {}
        try:
            for f in (port / "counters").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    raw[f.name] = int(f.read_text().strip())
        except OSError:
            pass
        cur: dict[str, int] = {}
        for name, as_nic in _IB_WORDS.items():
            if name in raw:
                cur[as_nic] = 4 * raw[name]
        for name, as_nic in _IB_AS_NIC.items():
            if name in raw:
                cur[as_nic] = raw[name]
        m: Metrics = dict(cur)
        m.update({h: raw[h] for h in _IB_HEALTH if h in raw})
        state = _read_text(port / "state")  # "4: ACTIVE"
        m["ib_state"] = state.split(":", 1)[-1].strip() if state else None
        m["operstate"] = None if state is None else ("up" if m["ib_state"] == "ACTIVE" else "down")
        m["phys_state"] = (_read_text(port / "phys_state") or "").split(":", 1)[-1].strip() or None
        m["speed_mbps"] = _parse_ib_rate_mbps(_read_text(port / "rate"))
        m["link_layer"] = _read_text(port / "link_layer")
        prev = self._prev.get(key)
        dt = now - prev[0] if prev is not None else None
        rated = {c: r for c, r in _RATED.items() if c in cur}
        reset = prev is not None and any(cur[c] < prev[1].get(c, 0) for c in rated)
        if prev is None or dt is None or dt <= 0 or reset:
            m["interval_s"] = None
            m.update({r: None for r in rated.values()})
            if reset:
                m["counter_reset"] = True
        else:
            m["interval_s"] = dt
            for c, r in rated.items():
                m[r] = (cur[c] - prev[1][c]) / dt if c in prev[1] else None
        self._prev[key] = (now, cur)
        return m


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------


def _load_pynvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; imported lazily so a node without it still runs

    return pynvml


#: XID errors remembered per GPU (the newest; the count covers all of them).
XID_RECENT = 8
#: Most XID events taken from NVML per collection (the rest wait for the next one).
XID_DRAIN_MAX = 256


class GpuCollector:
    """Per-GPU utilisation, memory, temperature, power, ECC and XID errors through NVML.

    ``nvml`` is the pynvml module or a fake with the same functions. When NVML cannot start (no
    driver, no GPU) the collector reports why, and tries again at most every ``retry_s``.

    XID errors (the driver's reports of a GPU fault: 48 double-bit ECC, 79 fallen off the bus, ...)
    are NVML *events*: the collector registers every GPU that supports them for
    ``nvmlEventTypeXidCriticalError`` once, and drains the event set without waiting at each
    collection. Per device: ``xid_errors`` (count since the agent started), ``last_xid`` and
    ``recent_xids`` (newest last); ``None`` with ``xid_reason`` where XID events are unsupported or
    could not be registered (a container without the rights, say).
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
        self._events: Any = None  # the NVML event set XIDs arrive on (None: none registered)
        self._xid_reason: dict[int, str] = {}  # device index -> why it has no XID events
        self._xids: dict[int, list[int]] = {}  # device index -> recent XID codes
        self._xid_count: dict[int, int] = {}
        self._xid_registered = False

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
        if not self._xid_registered:
            self._register_xid(count)
        self._drain_xid()
        devices = []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # noqa: BLE001 - a lost GPU is reported, not raised
                devices.append({"index": i, **unavailable(_describe(exc)), **self._xid_metrics(i)})
                continue
            devices.append({"index": i, "available": True, **self._device(h), **self._xid_metrics(i)})
        return {"available": True, "count": count, "devices": devices}

    # -- XID errors -------------------------------------------------------------------------------
    def _register_xid(self, count: int) -> None:
        """Register every GPU that supports XID events on one event set (once)."""
        nv: Any = self._nvml
        self._xid_registered = True
        xid_type = getattr(nv, "nvmlEventTypeXidCriticalError", None)
        if xid_type is None or not hasattr(nv, "nvmlEventSetCreate"):
            self._xid_reason = dict.fromkeys(range(count), "this NVML binding has no XID events")
            return
        try:
            self._events = nv.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001 - reported as data
            self._xid_reason = dict.fromkeys(range(count), f"nvmlEventSetCreate failed: {_describe(exc)}")
            return
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                if not nv.nvmlDeviceGetSupportedEventTypes(h) & xid_type:
                    self._xid_reason[i] = "XID events not supported by this GPU"
                    continue
                nv.nvmlDeviceRegisterEvents(h, xid_type, self._events)
            except Exception as exc:  # noqa: BLE001 - no rights, not supported: reported as data
                self._xid_reason[i] = f"cannot register XID events: {_describe(exc)}"
                continue
            self._xids[i], self._xid_count[i] = [], 0

    def _drain_xid(self) -> None:
        """Take the XID events NVML holds, without waiting."""
        if self._events is None or not self._xids:
            return
        nv: Any = self._nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        timeout_error = getattr(nv, "NVMLError_Timeout", None)
        for _ in range(XID_DRAIN_MAX):
            try:
                ev = wait(self._events, 0)
            except Exception as exc:  # noqa: BLE001 - a timeout means "no event"; anything else is logged
                if timeout_error is None or not isinstance(exc, timeout_error):
                    log.warning("reading NVML XID events failed: %s", _describe(exc))
                return
            try:
                index = int(nv.nvmlDeviceGetIndex(ev.device))
            except Exception:  # noqa: BLE001, S112 - a device that vanished: keep the event on no GPU
                continue
            if index not in self._xids:
                continue
            xid = int(ev.eventData)
            log.warning("GPU %d reported XID %d", index, xid)
            self._xid_count[index] += 1
            self._xids[index] = [*self._xids[index], xid][-XID_RECENT:]

    def _xid_metrics(self, index: int) -> Metrics:
        if index in self._xids:
            recent = self._xids[index]
            return {"xid_errors": self._xid_count[index], "last_xid": recent[-1] if recent else None,
                    "recent_xids": list(recent)}
        return {"xid_errors": None, "last_xid": None, "recent_xids": None,
                "xid_reason": self._xid_reason.get(index, "not registered")}

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


class CollectorLoop(BackgroundLoop):
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
        super().__init__()

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

    # -- background thread (BackgroundLoop: start, stop) ----------------------------------------------
    thread_name = "vigil-agent-collectors"

    def pause_s(self) -> float:
        return self._interval

    def tick(self) -> None:
        self.step()

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
