"""The bounded history of each node's host metrics (``GET /nodes/{id}/history`` reads it).

A heartbeat carries the node's whole ``host`` snapshot (agent/collectors.py, agent/gpu.py), which
``nodes.host`` keeps only the latest of. Ingest also stores a few numbers out of it, one small row
(``node_host_samples``) per heartbeat:

* ``system.cpu.percent``, ``system.memory.percent``, ``system.load.1m``; the fullest of
  ``system.disk.<path>.percent``;
* over ``nics.interfaces``: the sums of ``rx_bytes_per_s`` and ``tx_bytes_per_s``, of the error rates
  (``rx_errors_per_s + tx_errors_per_s``) and of the drop rates (``rx_dropped_per_s + tx_dropped_per_s``);
* over ``gpus.devices``: the mean ``util_percent`` and the mean of ``memory_used_bytes /
  memory_total_bytes`` in percent.

A part that is missing, reports ``{"available": false, ...}`` or holds no number is None (a sum or a
mean is over the entries that have the number; None when none has it): probes degrade, ingest
does not fail.

Bounds: a heartbeat within ``interval_s`` of a stored sample of the same node (before or after it:
a replayed spool is placed by the heartbeat's own time) stores nothing, and after each row stored
only the node's newest ``max_rows`` rows are kept, so the table holds at most ``max_rows`` rows per
node whatever the heartbeat rate. A duplicate batch never gets here (ingest is idempotent).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from controller.models import NodeHostSample

#: The columns of a host sample, in NodeHistoryPublic's order.
HOST_FIELDS = (
    "cpu_percent", "memory_percent", "disk_percent", "load_1m", "rx_bytes_per_s", "tx_bytes_per_s",
    "nic_errors_per_s", "nic_drops_per_s", "gpu_util_percent", "gpu_memory_percent",
)


@dataclass(frozen=True)
class HostHistoryLimits:
    """How much history ingest keeps per node (``VIGIL_HOST_HISTORY_*``)."""

    interval_s: float = 5.0
    max_rows: int = 2000


def _part(d: Any, *keys: str) -> dict[str, Any] | None:
    """``d[k1][k2]...`` when every level is a dict that is not marked unavailable, else None."""
    for k in keys:
        if not isinstance(d, dict) or d.get("available") is False:
            return None
        d = d.get(k)
    if not isinstance(d, dict) or d.get("available") is False:
        return None
    return d


def _num(d: dict[str, Any] | None, key: str) -> float | None:
    """A finite number (bools are not numbers here), else None."""
    if d is None:
        return None
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        v = float(v)
    except OverflowError:  # an integer beyond any float
        return None
    return v if math.isfinite(v) else None


def _sum(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) if kept else None


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _entries(d: Any) -> list[dict[str, Any]]:
    """The available dict entries of a mapping (``{name: {...}}``) or a list."""
    if d is None:
        return []
    items = d.values() if isinstance(d, dict) else d if isinstance(d, list) else []
    return [e for e in items if isinstance(e, dict) and e.get("available") is not False]


def _pair_sum(e: dict[str, Any], a: str, b: str) -> float | None:
    return _sum([_num(e, a), _num(e, b)])


def extract(host: dict[str, Any]) -> dict[str, float | None]:
    """The numbers of one heartbeat's ``host`` snapshot (module docstring), keyed by :data:`HOST_FIELDS`."""
    system = _part(host, "system")
    disks = _entries(system.get("disk")) if system is not None else []
    nics = _entries(_part(host, "nics", "interfaces"))
    gpus_part = _part(host, "gpus")
    gpus = _entries(gpus_part.get("devices") if gpus_part is not None and isinstance(gpus_part.get("devices"), list)
                    else None)

    def gpu_mem(g: dict[str, Any]) -> float | None:
        used, total = _num(g, "memory_used_bytes"), _num(g, "memory_total_bytes")
        return 100.0 * used / total if used is not None and total else None

    disk = [p for p in (_num(d, "percent") for d in disks) if p is not None]
    out = {
        "cpu_percent": _num(_part(system, "cpu"), "percent") if system is not None else None,
        "memory_percent": _num(_part(system, "memory"), "percent") if system is not None else None,
        "disk_percent": max(disk) if disk else None,
        "load_1m": _num(_part(system, "load"), "1m") if system is not None else None,
        "rx_bytes_per_s": _sum(_num(n, "rx_bytes_per_s") for n in nics),
        "tx_bytes_per_s": _sum(_num(n, "tx_bytes_per_s") for n in nics),
        "nic_errors_per_s": _sum(_pair_sum(n, "rx_errors_per_s", "tx_errors_per_s") for n in nics),
        "nic_drops_per_s": _sum(_pair_sum(n, "rx_dropped_per_s", "tx_dropped_per_s") for n in nics),
        "gpu_util_percent": _mean(_num(g, "util_percent") for g in gpus),
        "gpu_memory_percent": _mean(gpu_mem(g) for g in gpus),
    }
    # A sum of huge rates can overflow to infinity, which no JSON answer may carry.
    return {k: v if v is None or math.isfinite(v) else None for k, v in out.items()}


def record(session: Session, node_id: str, ts: float, host: dict[str, Any], limits: HostHistoryLimits) -> bool:
    """Store one heartbeat's numbers for ``node_id`` unless a sample within ``limits.interval_s`` is
    stored already; then keep the node's newest ``limits.max_rows``. Returns whether a row was stored."""
    H = NodeHostSample
    if limits.interval_s > 0 and session.scalar(
        select(H.id).where(H.node_id == node_id, H.ts > ts - limits.interval_s, H.ts < ts + limits.interval_s)
        .limit(1)
    ) is not None:
        return False
    session.execute(insert(H).values(node_id=node_id, ts=ts, **extract(host)))
    # The ts of the newest max_rows-th row: everything older goes (an index walk of max_rows entries).
    cutoff = (select(H.ts).where(H.node_id == node_id).order_by(H.ts.desc())
              .offset(limits.max_rows - 1).limit(1).scalar_subquery())
    session.execute(delete(H).where(H.node_id == node_id, H.ts < cutoff))
    return True


__all__ = ["HOST_FIELDS", "HostHistoryLimits", "extract", "record"]
