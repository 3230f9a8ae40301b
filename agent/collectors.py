"""Node metrics for the heartbeat: host (psutil), NICs (/proc and /sys), InfiniBand ports (/sys),
GPUs (NVML, with XID error events).

Every collector returns plain JSON-able data and never raises: what it cannot read it reports as
``{"available": False, "reason": ...}`` (no GPU, no NVML, an interface without a speed, ...).
The clock and the ``/proc`` and ``/sys`` roots are parameters, so tests drive rates from fake
counter files and a fake clock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import psutil

from vigil.contract.background import BackgroundLoop
from vigil.contract.link import parse_proc_net_dev

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




#: Below this many TCP segments sent per second the node's retransmit ratio is not reported.
MIN_SEGS_PER_S = 200.0


def parse_proc_net_snmp(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/snmp``: pairs of lines (``Tcp: Name ...`` then ``Tcp: value ...``) -> {"Tcp": {name: value}}."""
    out: dict[str, dict[str, int]] = {}
    lines = [ln.split() for ln in text.splitlines() if ln.strip()]
    for names, values in itertools.pairwise(lines):
        if names[0] == values[0] and names[0].endswith(":") and not names[1].lstrip("-").isdigit() \
                and len(names) == len(values):
            out[names[0][:-1]] = {n: int(v) for n, v in zip(names[1:], values[1:], strict=True)}
    return out


class NicCollector:
    """Per-interface counters, link state and rates computed from counter deltas, and the node's
    TCP retransmits (``tcp``).

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
        self._proc_snmp = Path(proc_root) / "net" / "snmp"
        self._prev_tcp: tuple[float, dict[str, int]] | None = None

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
        return {"available": True, "interfaces": interfaces, "tcp": self._tcp(now)}

    def _tcp(self, now: float) -> Metrics:
        """The node's TCP segments sent and retransmitted (``/proc/net/snmp``, this network namespace),
        with per-second rates and ``retrans_ratio`` (retransmitted / sent over the last interval;
        None under ``MIN_SEGS_PER_S`` sent, where a handful of retransmits would read as a high ratio).

        Packet loss on a node's link shows here first: the sender retransmits what the wire lost,
        while the NIC's own error and drop counters stay at zero (the loss is on the wire or beyond)."""
        try:
            tcp = parse_proc_net_snmp(self._proc_snmp.read_text()).get("Tcp", {})
            cur = {"out_segs": tcp["OutSegs"], "retrans_segs": tcp["RetransSegs"]}
        except (OSError, KeyError, ValueError) as exc:
            return unavailable(f"cannot read TCP counters from {self._proc_snmp}: {_describe(exc)}")
        m: Metrics = {"available": True, **cur, "out_segs_per_s": None, "retrans_segs_per_s": None,
                      "retrans_ratio": None}
        prev, self._prev_tcp = self._prev_tcp, (now, cur)
        if prev is None or now <= prev[0] or any(cur[k] < prev[1][k] for k in cur):
            return m
        dt = now - prev[0]
        out, retrans = (cur["out_segs"] - prev[1]["out_segs"]) / dt, (cur["retrans_segs"] - prev[1]["retrans_segs"]) / dt
        m.update(out_segs_per_s=out, retrans_segs_per_s=retrans,
                 retrans_ratio=retrans / out if out >= MIN_SEGS_PER_S else None)
        return m

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
