"""Pure builders of the fleet view (``/nodes``): one dash-ag-grid row per node, the grid's columns and
the one-line summary of the fleet.

Nothing here fetches data: every function maps wire-schema objects (:class:`NodePublic`,
:class:`NodeHistoryPublic`) to grid rows and column definitions, so the page's callbacks stay thin and
all of this is unit-tested without a server. A node's host metrics are summarised by
:func:`dashboard.pages.nodes.host_summary.summarize_host`; a part a node does not have (no GPU, no InfiniBand, a
probe that failed) shows as "n/a" with the reason as the cell's tooltip, never as an error. The GPU
and InfiniBand columns are hidden when no node has one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dashboard.format import DASH, NA, fmt_age, fmt_per_s, fmt_ranks, fmt_rate
from dashboard.pages.nodes.host_summary import finite_float, summarize_host
from vigil.contract.schemas import NodeHistoryPublic, NodePublic

SPARK_POINTS = 30
"""Points of history drawn in a grid cell's sparkline."""


def _spark(values: Sequence[float | None] | None, points: int = SPARK_POINTS) -> list[float | None]:
    """The last ``points`` values of a history series, for a cell's sparkline (None: a gap)."""
    if not values:
        return []
    return [finite_float(v) for v in list(values)[-points:]]


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
        "heartbeat_age_s": finite_float(node.heartbeat_age_s),
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
