"""Pure builders of the fleet view (``/nodes``), the node page (``/nodes/<id>``) and the compare page.

Nothing here fetches data: every function maps wire-schema objects (:class:`NodePublic`,
:class:`NodeHistoryPublic`, :class:`JobPublic`, :class:`JobOverviewPublic`) to grid rows, column
definitions, Plotly figures or small Dash components, so the pages' callbacks stay thin and all of
this is unit-tested without a server.

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
probe that failed): those show as "n/a" with the reason as the cell's tooltip, never as an error.
The GPU and InfiniBand columns are hidden when no node has one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import dash_bootstrap_components as dbc
import plotly.colors
import plotly.graph_objects as go
from dash import dcc, html

from controller.schemas import (
    IncidentPublic,
    JobOverviewPublic,
    JobPublic,
    NodeHistoryPublic,
    NodePublic,
    RankProcess,
)
from dashboard.format import DASH, fmt_age

NA = "n/a"
"""Shown where a node does not have (or could not measure) a metric."""
WAITING_TEXT = "waiting for data"
SPARK_POINTS = 30
"""Points of history drawn in a grid cell's sparkline."""

_MARGIN = {"l": 60, "r": 20, "t": 50, "b": 45}

# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, non-numeric, NaN, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def fmt_rate(bytes_per_s: float | None) -> str:
    """A byte rate in SI units: ``0 B/s``, ``512 B/s``, ``1.25 MB/s``; "n/a" for None."""
    if bytes_per_s is None:
        return NA
    v = float(bytes_per_s)
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B/s" else f"{v:.3g} {unit}"
        v /= 1000
    return f"{v:.3g} TB/s"


def fmt_per_s(value: float | None) -> str:
    """An event rate (errors, drops): ``0``, ``0.5/s``, ``12/s``; "n/a" for None."""
    if value is None:
        return NA
    return "0" if value == 0 else f"{value:.2g}/s"


def fmt_ranks(ranks: Sequence[RankProcess]) -> str:
    """Ranks grouped by job: ``job-a: 0, 1; job-b: 3``; a dead rank marked ``†``."""
    if not ranks:
        return DASH
    by_job: dict[str, list[str]] = {}
    for r in sorted(ranks, key=lambda r: (r.job_id, r.rank)):
        by_job.setdefault(r.job_id, []).append(f"{r.rank}" if r.alive else f"{r.rank}†")
    return "; ".join(f"{job}: {', '.join(rs)}" for job, rs in by_job.items())


# --------------------------------------------------------------------------------------------------
# A node's host metrics, summarised
# --------------------------------------------------------------------------------------------------


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

    system, why = _part(host, "system")
    for key in ("cpu", "memory", "load"):
        part, part_why = _part(system, key) if system is not None else (None, why)
        if part is None:
            reasons[key] = part_why or "not reported"
            continue
        if key == "cpu":
            out["cpu_percent"] = _num(part.get("percent"))
            count = part.get("count")
            out["cpu_count"] = count if isinstance(count, int) and not isinstance(count, bool) else None
        elif key == "memory":
            out["memory_percent"] = _num(part.get("percent"))
        else:
            out["load_1m"] = _num(part.get("1m"))
        if out.get({"cpu": "cpu_percent", "memory": "memory_percent", "load": "load_1m"}[key]) is None:
            reasons[key] = "no value reported"
    disks = system.get("disk") if system is not None else None
    fullest: tuple[float, str] | None = None
    if isinstance(disks, Mapping):
        for path, d in disks.items():
            pct = _num(d.get("percent")) if isinstance(d, Mapping) and d.get("available") is not False else None
            if pct is not None and (fullest is None or pct > fullest[0]):
                fullest = (pct, str(path))
    if fullest is not None:
        out["disk_percent"], out["disk_path"] = fullest
    else:
        reasons["disk"] = why or "no disk reported"

    nics, why = _part(host, "nics")
    interfaces = nics.get("interfaces") if nics is not None else None
    if isinstance(interfaces, Mapping):
        ifs = [m for m in interfaces.values() if isinstance(m, Mapping)]
        out["nic_count"] = len(ifs)
        out["nic_rx_bps"] = _sum(_num(m.get("rx_bytes_per_s")) for m in ifs)
        out["nic_tx_bps"] = _sum(_num(m.get("tx_bytes_per_s")) for m in ifs)
        out["nic_errors_per_s"] = _sum(_num(m.get(k)) for m in ifs for k in ("rx_errors_per_s", "tx_errors_per_s"))
        out["nic_drops_per_s"] = _sum(_num(m.get(k)) for m in ifs for k in ("rx_dropped_per_s", "tx_dropped_per_s"))
        out["nics_down"] = tuple(sorted(str(n) for n, m in interfaces.items()
                                        if isinstance(m, Mapping) and m.get("operstate") == "down"))
        if out["nic_rx_bps"] is None:
            reasons["nic"] = "no rate yet (the first reading only starts the counters)"
    else:
        reasons["nic"] = why or "no interfaces reported"

    gpus, why = _part(host, "gpus")
    devices = gpus.get("devices") if gpus is not None else None
    if isinstance(devices, list) and devices:
        ok = [d for d in devices if isinstance(d, Mapping) and d.get("available") is not False]
        count = gpus.get("count") if gpus is not None else None
        out["gpu_count"] = count if isinstance(count, int) and not isinstance(count, bool) else len(devices)
        utils = [u for d in ok if (u := _num(d.get("util_percent"))) is not None]
        out["gpu_util_percent"] = sum(utils) / len(utils) if utils else None
        used = [_num(d.get("memory_used_bytes")) for d in ok]
        total = [_num(d.get("memory_total_bytes")) for d in ok]
        pairs = [(u, t) for u, t in zip(used, total, strict=True) if u is not None and t]
        if pairs:
            out["gpu_memory_percent"] = 100.0 * sum(u for u, _ in pairs) / sum(t for _, t in pairs)
        temps = [t for d in ok if (t := _num(d.get("temperature_c"))) is not None]
        out["gpu_temp_c"] = max(temps) if temps else None
        if not ok:
            reasons["gpu"] = "; ".join(str(d.get("reason", "unavailable")) for d in devices if isinstance(d, Mapping))
    else:
        reasons["gpu"] = why or "no GPU on this node"

    ib, why = _part(host, "infiniband")
    ports = ib.get("ports") if ib is not None else None
    if isinstance(ports, Mapping) and ports:
        ps = [m for m in ports.values() if isinstance(m, Mapping)]
        out["ib_ports"] = len(ps)
        out["ib_rx_bps"] = _sum(_num(m.get("rx_bytes_per_s")) for m in ps)
        out["ib_tx_bps"] = _sum(_num(m.get("tx_bytes_per_s")) for m in ps)
        out["ib_errors_per_s"] = _sum(_num(m.get(k)) for m in ps for k in ("rx_errors_per_s", "tx_dropped_per_s"))
    else:
        reasons["ib"] = why or "no InfiniBand port"
    return HostSummary(**out, reasons=reasons)


# --------------------------------------------------------------------------------------------------
# The fleet grid (dash-ag-grid)
# --------------------------------------------------------------------------------------------------


def _spark(values: Sequence[float | None] | None, points: int = SPARK_POINTS) -> list[float | None]:
    """The last ``points`` values of a history series, for a cell's sparkline (None: a gap)."""
    if not values:
        return []
    return [_num(v) for v in list(values)[-points:]]


def fleet_row(
    node: NodePublic, history: NodeHistoryPublic | None = None, link_prefix: str = "/"
) -> dict[str, Any]:
    """One grid row of ``node``: plain JSON values (numbers stay numbers, so columns sort and filter
    as numbers), the texts shown, the tooltips' reasons, and sparkline series from ``history``."""
    h = summarize_host(node.host)
    r = h.reasons
    return {
        "id": node.id,
        "href": f"{link_prefix}nodes/{node.id}",
        "hostname": node.hostname or DASH,
        "address": node.address or DASH,
        "state": node.state.value,
        "heartbeat_age_s": _num(node.heartbeat_age_s),
        "heartbeat": fmt_age(node.heartbeat_age_s),
        "ranks": fmt_ranks(node.ranks),
        "rank_count": len(node.ranks),
        "cpu_percent": h.cpu_percent,
        "cpu_note": r.get("cpu") or (f"{h.cpu_count} CPUs" if h.cpu_count else ""),
        "memory_percent": h.memory_percent,
        "memory_note": r.get("memory", ""),
        "disk_percent": h.disk_percent,
        "disk_note": r.get("disk") or (f"fullest disk: {h.disk_path}" if h.disk_path else ""),
        "load_1m": h.load_1m,
        "load_note": r.get("load", ""),
        "nic_rx_bps": h.nic_rx_bps,
        "nic_rx_text": fmt_rate(h.nic_rx_bps),
        "nic_rx_hist": _spark(history.rx_bytes_per_s) if history else [],
        "nic_tx_bps": h.nic_tx_bps,
        "nic_tx_text": fmt_rate(h.nic_tx_bps),
        "nic_tx_hist": _spark(history.tx_bytes_per_s) if history else [],
        "nic_errors_per_s": h.nic_errors_per_s,
        "nic_errors_text": fmt_per_s(h.nic_errors_per_s),
        "nic_drops_per_s": h.nic_drops_per_s,
        "nic_drops_text": fmt_per_s(h.nic_drops_per_s),
        "nic_note": r.get("nic") or (f"down: {', '.join(h.nics_down)}" if h.nics_down
                                     else f"{h.nic_count} interface(s)"),
        "nics_down": len(h.nics_down),
        "gpu_count": h.gpu_count,
        "gpu_count_text": NA if h.gpu_count is None else str(h.gpu_count),
        "gpu_util_percent": h.gpu_util_percent,
        "gpu_memory_percent": h.gpu_memory_percent,
        "gpu_temp_c": h.gpu_temp_c,
        "gpu_note": r.get("gpu", ""),
        "ib_ports": h.ib_ports,
        "ib_rx_bps": h.ib_rx_bps,
        "ib_rx_text": fmt_rate(h.ib_rx_bps) if h.ib_ports else NA,
        "ib_tx_bps": h.ib_tx_bps,
        "ib_tx_text": fmt_rate(h.ib_tx_bps) if h.ib_ports else NA,
        "ib_errors_per_s": h.ib_errors_per_s,
        "ib_errors_text": fmt_per_s(h.ib_errors_per_s) if h.ib_ports else NA,
        "ib_note": r.get("ib", ""),
    }


def fleet_rows(
    nodes: Iterable[NodePublic],
    histories: Mapping[str, NodeHistoryPublic | None] | None = None,
    link_prefix: str = "/",
) -> list[dict[str, Any]]:
    """One row per node, in the controller's order (the grid sorts as the user asks)."""
    histories = histories or {}
    return [fleet_row(n, histories.get(n.id), link_prefix) for n in nodes]


_STATE_STYLE = {
    "styleConditions": [
        {"condition": "params.value == 'ALIVE'", "style": {"color": "#2ca02c", "fontWeight": "bold"}},
        {"condition": "params.value == 'DEAD'", "style": {"color": "#d62728", "fontWeight": "bold"}},
        {"condition": "params.value == 'EVICTED'", "style": {"color": "#ff7f0e", "fontWeight": "bold"}},
    ]
}
_NONZERO_RED = {"styleConditions": [{"condition": "params.value > 0", "style": {"color": "#d62728"}}]}


def _bar(field_: str, header: str, note: str, **extra: Any) -> dict[str, Any]:
    return {"field": field_, "headerName": header, "cellRenderer": "VigilBar", "tooltipField": note,
            "filter": "agNumberColumnFilter", "width": 120, **extra}


def _rate(field_: str, header: str, text: str, hist: str | None, note: str, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"textField": text}
    if hist:
        params["histField"] = hist
    return {"field": field_, "headerName": header, "cellRenderer": "VigilRate", "cellRendererParams": params,
            "tooltipField": note, "filter": "agNumberColumnFilter", "width": 170 if hist else 110, **extra}


def _counted(field_: str, header: str, text: str, note: str, **extra: Any) -> dict[str, Any]:
    return {"field": field_, "headerName": header, "valueFormatter": {"function": f"params.data.{text}"},
            "tooltipField": note, "filter": "agNumberColumnFilter", "cellStyle": _NONZERO_RED, "width": 110,
            **extra}


def fleet_columns(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The grid's columns; the GPU and InfiniBand groups are hidden unless some row has a GPU / a port.

    Cells use the renderers of ``dashboard/assets/vigil_grid.js``: ``VigilLink`` (the node's page),
    ``VigilBar`` (a percentage bar, "n/a" for null) and ``VigilRate`` (a rate with its sparkline).
    """
    has_gpu = any(r.get("gpu_count") for r in rows)
    has_ib = any(r.get("ib_ports") for r in rows)
    return [
        {"field": "id", "headerName": "Node", "cellRenderer": "VigilLink", "pinned": "left", "width": 130},
        {"field": "hostname", "headerName": "Host", "width": 130},
        {"field": "address", "headerName": "Address", "width": 120},
        {"field": "state", "headerName": "State", "cellStyle": _STATE_STYLE, "width": 100},
        {"field": "heartbeat_age_s", "headerName": "Heartbeat", "valueFormatter": {"function": "params.data.heartbeat"},
         "filter": "agNumberColumnFilter", "width": 110},
        {"field": "ranks", "headerName": "Ranks", "width": 160},
        _bar("cpu_percent", "CPU", "cpu_note"),
        _bar("memory_percent", "Memory", "memory_note"),
        _bar("disk_percent", "Disk", "disk_note"),
        {"field": "load_1m", "headerName": "Load 1m", "tooltipField": "load_note", "filter": "agNumberColumnFilter",
         "valueFormatter": {"function": "params.value == null ? 'n/a' : d3.format('.2f')(params.value)"},
         "width": 100},
        _rate("nic_rx_bps", "NIC rx", "nic_rx_text", "nic_rx_hist", "nic_note"),
        _rate("nic_tx_bps", "NIC tx", "nic_tx_text", "nic_tx_hist", "nic_note"),
        _counted("nic_errors_per_s", "NIC errors", "nic_errors_text", "nic_note"),
        _counted("nic_drops_per_s", "NIC drops", "nic_drops_text", "nic_note"),
        {"field": "gpu_count", "headerName": "GPUs", "valueFormatter": {"function": "params.data.gpu_count_text"},
         "tooltipField": "gpu_note", "filter": "agNumberColumnFilter", "width": 90, "hide": not has_gpu},
        _bar("gpu_util_percent", "GPU util", "gpu_note", hide=not has_gpu),
        _bar("gpu_memory_percent", "GPU memory", "gpu_note", hide=not has_gpu),
        {"field": "gpu_temp_c", "headerName": "GPU temp", "tooltipField": "gpu_note", "filter": "agNumberColumnFilter",
         "valueFormatter": {"function": "params.value == null ? 'n/a' : d3.format('.0f')(params.value) + ' °C'"},
         "width": 100, "hide": not has_gpu},
        _rate("ib_rx_bps", "IB rx", "ib_rx_text", None, "ib_note", hide=not has_ib),
        _rate("ib_tx_bps", "IB tx", "ib_tx_text", None, "ib_note", hide=not has_ib),
        _counted("ib_errors_per_s", "IB errors", "ib_errors_text", "ib_note", hide=not has_ib),
    ]


def fleet_summary(nodes: Sequence[NodePublic]) -> str:
    """``3 nodes: 2 ALIVE, 1 DEAD`` (states in a fixed order)."""
    if not nodes:
        return "no nodes have reported yet"
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n.state.value] = counts.get(n.state.value, 0) + 1
    parts = [f"{counts[s]} {s}" for s in ("ALIVE", "DEAD", "EVICTED") if s in counts]
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {', '.join(parts)}"


# --------------------------------------------------------------------------------------------------
# Figures (node page, compare page)
# --------------------------------------------------------------------------------------------------


def empty_figure(title: str = "", message: str = WAITING_TEXT) -> go.Figure:
    """A figure with no traces and ``message`` centred in it (axes hidden)."""
    fig = go.Figure()
    fig.update_layout(
        title={"text": title}, margin=_MARGIN, xaxis={"visible": False}, yaxis={"visible": False},
        annotations=[{"text": message, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
                      "font": {"size": 16, "color": "#888"}}],
    )
    return fig


def _times(ts: Sequence[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, UTC) for t in ts]


def _time_lines(
    history: NodeHistoryPublic | None,
    series: Sequence[tuple[str, str]],
    title: str,
    y_title: str,
    *,
    y_range: tuple[float, float] | None = None,
    absent: str = WAITING_TEXT,
) -> go.Figure:
    """One line per ``(label, NodeHistoryPublic field)`` against time; series with no value are left out.
    No point at all gives an empty figure saying ``absent``."""
    if history is None or not history.ts:
        return empty_figure(title)
    x = _times(history.ts)
    fig = go.Figure()
    for label, name in series:
        values = getattr(history, name)
        if not any(v is not None for v in values):
            continue
        fig.add_trace(go.Scatter(x=x, y=list(values), mode="lines", name=label, connectgaps=False))
    if not fig.data:
        return empty_figure(title, absent)
    yaxis: dict[str, Any] = {"title": {"text": y_title}}
    if y_range is not None:
        yaxis["range"] = list(y_range)
    fig.update_layout(title={"text": title}, margin=_MARGIN, xaxis={"title": {"text": "time (UTC)"}}, yaxis=yaxis,
                      uirevision=f"{history.node_id}-{title}", legend={"orientation": "h", "y": -0.25})
    return fig


def node_utilisation_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """CPU, memory and (fullest) disk use in percent against time."""
    return _time_lines(history, [("CPU", "cpu_percent"), ("memory", "memory_percent"), ("disk", "disk_percent")],
                       "CPU, memory, disk", "%", y_range=(0, 100))


def node_load_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """The 1-minute load average against time."""
    return _time_lines(history, [("load 1m", "load_1m")], "Load average", "runnable tasks")


def node_network_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """Bytes per second received and sent (summed over the node's interfaces) against time."""
    fig = _time_lines(history, [("rx", "rx_bytes_per_s"), ("tx", "tx_bytes_per_s")], "Network", "bytes / s")
    if fig.data:
        fig.update_yaxes(tickformat="~s")
    return fig


def node_nic_errors_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """NIC errors and drops per second (summed over interfaces) against time."""
    return _time_lines(history, [("errors", "nic_errors_per_s"), ("drops", "nic_drops_per_s")],
                       "NIC errors and drops", "per second")


def node_gpu_figure(history: NodeHistoryPublic | None) -> go.Figure:
    """Mean GPU utilisation and GPU memory use in percent; "no GPU" when the node never reported one."""
    return _time_lines(history, [("GPU util", "gpu_util_percent"), ("GPU memory", "gpu_memory_percent")],
                       "GPUs", "%", y_range=(0, 100), absent="no GPU on this node")


def history_has_gpu(history: NodeHistoryPublic | None) -> bool:
    return history is not None and any(v is not None for v in history.gpu_util_percent + history.gpu_memory_percent)


MAX_COMPARED_JOBS = 8
"""The compare page shows at most this many jobs at once."""


def parse_job_ids(value: str | Sequence[str] | None) -> list[str]:
    """``"a,b, a"`` (``?jobs=``) or a list of ids -> ``["a", "b"]``: in order, without repeats or
    blanks, at most :data:`MAX_COMPARED_JOBS`."""
    parts = value.split(",") if isinstance(value, str) else list(value or [])
    out: list[str] = []
    for part in parts:
        part = str(part).strip()
        if part and part not in out:
            out.append(part)
    return out[:MAX_COMPARED_JOBS]


def cumulative_bits(steps: Sequence[int], wire_bytes: Sequence[int]) -> list[float]:
    """Bits put on the wire by the end of each step: the running sum of ``wire_bytes`` x 8.

    ``steps`` ascending. When the series is thinned (a gap of ``g`` steps between two points), the
    point stands for its gap: its bytes count ``g`` times, so the total stays an estimate of all
    steps rather than of the points shown; without gaps (the usual case) the sum is exact.
    """
    out: list[float] = []
    total = 0.0
    prev: int | None = None
    for step, nbytes in zip(steps, wire_bytes, strict=True):
        weight = 1 if prev is None else max(step - prev, 1)
        total += 8.0 * float(nbytes) * weight
        out.append(total)
        prev = step
    return out


def elapsed_s(ts: Sequence[float]) -> list[float]:
    """Seconds since the first point (the job's first reported step)."""
    if not ts:
        return []
    t0 = ts[0]
    return [t - t0 for t in ts]


@dataclass(frozen=True)
class CompareTrace:
    """One job's curves on the compare page."""

    job_id: str
    label: str
    step: list[int]
    loss: list[float | None]
    elapsed_s: list[float]
    bits: list[float]


def job_label(job: JobPublic) -> str:
    """``name (optimizer)``: how the compare page names a job's traces."""
    return f"{job.name} ({job.spec.optimizer.kind})"


def compare_traces(entries: Sequence[tuple[JobPublic, JobOverviewPublic | None]]) -> list[CompareTrace]:
    """A :class:`CompareTrace` per job, labelled ``name (optimizer)`` (and the id where two labels clash)."""
    labels = [job_label(job) for job, _ in entries]
    out = []
    for (job, ov), label in zip(entries, labels, strict=True):
        if labels.count(label) > 1:
            label = f"{label} {job.id}"
        if ov is None:
            out.append(CompareTrace(job.id, label, [], [], [], []))
            continue
        out.append(CompareTrace(job.id, label, list(ov.step), list(ov.loss), elapsed_s(ov.ts),
                                cumulative_bits(ov.step, ov.wire_bytes)))
    return out


COMPARE_AXES = (
    ("step", "Loss vs step", "step"),
    ("elapsed_s", "Loss vs wall time", "seconds since the first step"),
    ("bits", "Loss vs bits sent", "bits sent (cumulative, all ranks)"),
)
"""The compare page's three figures: (CompareTrace field on x, title, x-axis title)."""


def compare_figures(traces: Sequence[CompareTrace]) -> list[go.Figure]:
    """Loss against step, wall time and cumulative bits sent: one trace per job in each, same colour
    per job across the three."""
    figs = []
    palette = plotly.colors.qualitative.Plotly
    for x_field, title, x_title in COMPARE_AXES:
        with_data = [t for t in traces if t.step]
        if not with_data:
            figs.append(empty_figure(title, "pick jobs to compare" if not traces else WAITING_TEXT))
            continue
        fig = go.Figure()
        for i, t in enumerate(traces):
            if not t.step:
                continue
            fig.add_trace(go.Scatter(
                x=getattr(t, x_field), y=t.loss, mode="lines" if len(t.step) > 1 else "lines+markers",
                name=t.label, legendgroup=t.job_id, line={"color": palette[i % len(palette)]}, connectgaps=False,
                customdata=t.step, hovertemplate="%{fullData.name}<br>step %{customdata}: loss %{y:.4g}<extra></extra>",
            ))
        xaxis: dict[str, Any] = {"title": {"text": x_title}}
        if x_field == "bits":
            xaxis["tickformat"] = "~s"
        fig.update_layout(title={"text": title}, margin=_MARGIN, xaxis=xaxis, yaxis={"title": {"text": "loss"}},
                          showlegend=True, legend={"orientation": "h", "y": -0.3}, uirevision=title)
        if x_field == "bits" and not any(b for t in with_data for b in t.bits):
            fig.add_annotation(text="no collective traffic reported", xref="paper", yref="paper", x=0.5, y=0.95,
                               showarrow=False, font={"color": "#888"})
        figs.append(fig)
    return figs


# --------------------------------------------------------------------------------------------------
# Node page tables
# --------------------------------------------------------------------------------------------------


def node_facts(node: NodePublic) -> html.Div:
    """The node page's header line: state, host, address, heartbeat, agent."""
    color = {"ALIVE": "success", "DEAD": "danger", "EVICTED": "warning"}.get(node.state.value, "secondary")
    facts = [("host", node.hostname or DASH), ("address", node.address or DASH),
             ("heartbeat", fmt_age(node.heartbeat_age_s) + (" ago" if node.heartbeat_age_s is not None else "")),
             ("agent", node.agent_id or DASH)]
    return html.Div([
        html.H2([f"Node {node.id} ", dbc.Badge(node.state.value, color=color, id="node-detail-state")],
                id="node-detail-title"),
        html.Div([html.Span([html.B(f"{k}: "), v], className="me-3") for k, v in facts], id="node-detail-facts"),
    ])


def ranks_table(ranks: Sequence[RankProcess], link_prefix: str) -> Any:
    """The ranks the node's agent sees: job (linked), rank, pid, alive."""
    if not ranks:
        return html.Div("no ranks on this node", className="text-muted")
    rows = [
        html.Tr([html.Td(dcc.Link(r.job_id, href=f"{link_prefix}jobs/{r.job_id}")), html.Td(str(r.rank)),
                 html.Td(str(r.pid)), html.Td("yes" if r.alive else "no")],
                className="vigil-rank-row", **{"data-rank": str(r.rank)})
        for r in sorted(ranks, key=lambda r: (r.job_id, r.rank))
    ]
    head = html.Thead(html.Tr([html.Th(c) for c in ("job", "rank", "pid", "alive")]))
    return dbc.Table([head, html.Tbody(rows)], size="sm", striped=True, hover=True)


def incidents_table(incidents: Sequence[IncidentPublic], link_prefix: str) -> Any:
    """Incidents on the node, newest first: when, kind, status, job (linked), rank, action."""
    if not incidents:
        return html.Div("no incidents on this node", className="text-muted")
    rows = [
        html.Tr([
            html.Td(i.detected_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if i.detected_at.tzinfo
                    else i.detected_at.strftime("%Y-%m-%d %H:%M:%S")),
            html.Td(i.kind.value), html.Td(i.status.value),
            html.Td(dcc.Link(i.job_id, href=f"{link_prefix}jobs/{i.job_id}") if i.job_id else DASH),
            html.Td(DASH if i.rank is None else str(i.rank)), html.Td(i.action or DASH),
        ], className="vigil-incident-row", **{"data-incident-id": str(i.id)})
        for i in incidents
    ]
    head = html.Thead(html.Tr([html.Th(c) for c in ("detected", "kind", "status", "job", "rank", "action")]))
    return dbc.Table([head, html.Tbody(rows)], size="sm", striped=True, hover=True)
