"""A node's ``host`` dict summarised into the few numbers the fleet view shows (:class:`HostSummary`),
with the reason for each part that is not available.

A node's ``host`` dict is what its agent's collectors reported (``agent/collectors.py``,
``agent/gpu.py``)::

    {"system": {"cpu": {"percent", "count"}, "memory": {"percent", ...},
                "disk": {path: {"percent", ...}}, "load": {"1m", "5m", "15m"}},
     "nics": {"interfaces": {name: {"rx_bytes_per_s", "tx_bytes_per_s", "rx_errors_per_s", ...}}},
     "infiniband": {"ports": {"mlx5_0/1": {... the same rate names ...}}},
     "gpus": {"count", "devices": [{"util_percent", "memory_used_bytes", "memory_total_bytes",
                                    "temperature_c", ...}]},
     "agent": {...}}

Any part may be missing, or ``{"available": false, "reason": "..."}`` (no GPU, no InfiniBand, a
probe that failed): such a part is None in the summary with the reason in ``reasons`` (the fleet
grid shows "n/a" with the reason as the cell's tooltip), never an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def finite_float(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, non-numeric, NaN, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _part(parent: Any, key: str) -> tuple[Mapping[str, Any] | None, str | None]:
    """``parent[key]`` when it is an available dict, else (None, why not)."""
    if not isinstance(parent, Mapping):
        return None, "not reported"
    value = parent.get(key)
    if value is None:
        return None, "not reported"
    if not isinstance(value, Mapping):
        return None, "not understood"
    if value.get("available") is False:
        return None, str(value.get("reason") or "unavailable")
    return value, None


def _sum(values: Iterable[float | None]) -> float | None:
    """Sum of the known values; None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


@dataclass(frozen=True)
class HostSummary:
    """What the fleet view shows of one node's ``host`` dict; None: not available (see ``reasons``)."""

    cpu_percent: float | None = None
    cpu_count: int | None = None
    memory_percent: float | None = None
    disk_percent: float | None = None
    """The fullest of the node's disks."""
    disk_path: str | None = None
    load_1m: float | None = None
    nic_count: int = 0
    nic_rx_bps: float | None = None
    """Bytes per second received, summed over the node's interfaces."""
    nic_tx_bps: float | None = None
    nic_errors_per_s: float | None = None
    """rx + tx errors per second, over all interfaces."""
    nic_drops_per_s: float | None = None
    nics_down: tuple[str, ...] = ()
    """Interfaces whose operstate is ``down``."""
    gpu_count: int | None = None
    """None: no GPU (or no NVML); see ``reasons["gpu"]``."""
    gpu_util_percent: float | None = None
    """Mean over the node's GPUs."""
    gpu_memory_percent: float | None = None
    """Memory used over memory total, all GPUs together."""
    gpu_temp_c: float | None = None
    """The hottest GPU."""
    ib_ports: int | None = None
    """None: no InfiniBand (see ``reasons["ib"]``)."""
    ib_rx_bps: float | None = None
    ib_tx_bps: float | None = None
    ib_errors_per_s: float | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    """Why a part is n/a, by part: cpu, memory, disk, load, nic, gpu, ib."""


def summarize_host(host: Mapping[str, Any] | None) -> HostSummary:
    """Summarise an agent's ``host`` dict (see the module docstring); never raises on odd input."""
    host = host if isinstance(host, Mapping) else {}
    out: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    _summarize_system(host, out, reasons)
    _summarize_nics(host, out, reasons)
    _summarize_gpus(host, out, reasons)
    _summarize_ib(host, out, reasons)
    return HostSummary(**out, reasons=reasons)


def _int_count(value: Any) -> int | None:
    """``value`` when it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _summarize_system(host: Mapping[str, Any], out: dict[str, Any], reasons: dict[str, str]) -> None:
    """CPU, memory, load and the fullest disk into ``out`` (:class:`HostSummary` fields), or why not."""
    system, why = _part(host, "system")
    for key in ("cpu", "memory", "load"):
        part, part_why = _part(system, key) if system is not None else (None, why)
        if part is None:
            reasons[key] = part_why or "not reported"
            continue
        if key == "cpu":
            out["cpu_percent"] = finite_float(part.get("percent"))
            out["cpu_count"] = _int_count(part.get("count"))
        elif key == "memory":
            out["memory_percent"] = finite_float(part.get("percent"))
        else:
            out["load_1m"] = finite_float(part.get("1m"))
        if out.get({"cpu": "cpu_percent", "memory": "memory_percent", "load": "load_1m"}[key]) is None:
            reasons[key] = "no value reported"
    disks = system.get("disk") if system is not None else None
    fullest: tuple[float, str] | None = None
    if isinstance(disks, Mapping):
        for path, d in disks.items():
            pct = finite_float(d.get("percent")) if isinstance(d, Mapping) and d.get("available") is not False else None
            if pct is not None and (fullest is None or pct > fullest[0]):
                fullest = (pct, str(path))
    if fullest is not None:
        out["disk_percent"], out["disk_path"] = fullest
    else:
        reasons["disk"] = why or "no disk reported"


def _summarize_nics(host: Mapping[str, Any], out: dict[str, Any], reasons: dict[str, str]) -> None:
    """The interfaces' rates, errors, drops and those down, summed over the node, or why not."""
    nics, why = _part(host, "nics")
    interfaces = nics.get("interfaces") if nics is not None else None
    if not isinstance(interfaces, Mapping):
        reasons["nic"] = why or "no interfaces reported"
        return
    ifs = [m for m in interfaces.values() if isinstance(m, Mapping)]
    out["nic_count"] = len(ifs)
    out["nic_rx_bps"] = _sum(finite_float(m.get("rx_bytes_per_s")) for m in ifs)
    out["nic_tx_bps"] = _sum(finite_float(m.get("tx_bytes_per_s")) for m in ifs)
    out["nic_errors_per_s"] = _sum(finite_float(m.get(k)) for m in ifs for k in ("rx_errors_per_s", "tx_errors_per_s"))
    out["nic_drops_per_s"] = _sum(finite_float(m.get(k)) for m in ifs for k in ("rx_dropped_per_s", "tx_dropped_per_s"))
    out["nics_down"] = tuple(sorted(str(n) for n, m in interfaces.items()
                                    if isinstance(m, Mapping) and m.get("operstate") == "down"))
    if out["nic_rx_bps"] is None:
        reasons["nic"] = "no rate yet (the first reading only starts the counters)"


def _summarize_gpus(host: Mapping[str, Any], out: dict[str, Any], reasons: dict[str, str]) -> None:
    """GPU count, mean utilisation, memory use over all GPUs and the hottest GPU, or why not."""
    gpus, why = _part(host, "gpus")
    devices = gpus.get("devices") if gpus is not None else None
    if not isinstance(devices, list) or not devices:
        reasons["gpu"] = why or "no GPU on this node"
        return
    ok = [d for d in devices if isinstance(d, Mapping) and d.get("available") is not False]
    count = _int_count(gpus.get("count")) if gpus is not None else None
    out["gpu_count"] = count if count is not None else len(devices)
    utils = [u for d in ok if (u := finite_float(d.get("util_percent"))) is not None]
    out["gpu_util_percent"] = sum(utils) / len(utils) if utils else None
    used = [finite_float(d.get("memory_used_bytes")) for d in ok]
    total = [finite_float(d.get("memory_total_bytes")) for d in ok]
    pairs = [(u, t) for u, t in zip(used, total, strict=True) if u is not None and t]
    if pairs:
        out["gpu_memory_percent"] = 100.0 * sum(u for u, _ in pairs) / sum(t for _, t in pairs)
    temps = [t for d in ok if (t := finite_float(d.get("temperature_c"))) is not None]
    out["gpu_temp_c"] = max(temps) if temps else None
    if not ok:
        reasons["gpu"] = "; ".join(str(d.get("reason", "unavailable")) for d in devices if isinstance(d, Mapping))


def _summarize_ib(host: Mapping[str, Any], out: dict[str, Any], reasons: dict[str, str]) -> None:
    """InfiniBand ports and their rates and errors, summed over the node, or why not."""
    ib, why = _part(host, "infiniband")
    ports = ib.get("ports") if ib is not None else None
    if not isinstance(ports, Mapping) or not ports:
        reasons["ib"] = why or "no InfiniBand port"
        return
    ps = [m for m in ports.values() if isinstance(m, Mapping)]
    out["ib_ports"] = len(ps)
    out["ib_rx_bps"] = _sum(finite_float(m.get("rx_bytes_per_s")) for m in ps)
    out["ib_tx_bps"] = _sum(finite_float(m.get("tx_bytes_per_s")) for m in ps)
    out["ib_errors_per_s"] = _sum(finite_float(m.get(k)) for m in ps for k in ("rx_errors_per_s", "tx_dropped_per_s"))
