"""The node page's figures (``/nodes/<id>``): its history (utilisation, load, network, NIC errors,
GPUs) against time, built by pure functions from :class:`NodeHistoryPublic`, unit-tested without a
server.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from dashboard.figures.base import WAITING_TEXT, base_layout, empty_figure
from vigil.contract.schemas import NodeHistoryPublic


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
    return base_layout(fig, title, "time (UTC)", y_title, f"{history.node_id}-{title}", yaxis=yaxis,
                       legend={"orientation": "h", "y": -0.25})


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
