"""Table helpers every page shares, written once: the status colours and badge, the plain table's
styles, header and empty row, the error banner, and the sortable, filterable grid (dash-ag-grid).

Nothing here fetches data; a page's own tables (its rows and columns) live in its folder
(``dashboard/pages/<page>/tables.py``), built with these by pure functions from wire-schema objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import html

from vigil.contract.schemas import JobStatus, NodeState

STATUS_COLORS: dict[str, str] = {
    JobStatus.PENDING.value: "#8a8a8a",
    JobStatus.RUNNING.value: "#1f77b4",
    JobStatus.SUCCEEDED.value: "#2ca02c",
    JobStatus.FAILED.value: "#d62728",
    JobStatus.CANCELLED.value: "#ff7f0e",
    NodeState.ALIVE.value: "#2ca02c",
    NodeState.DEAD.value: "#d62728",
    NodeState.EVICTED.value: "#ff7f0e",
}

TABLE_STYLE = {"borderCollapse": "collapse", "width": "100%", "fontSize": "14px"}
CELL_STYLE = {"borderBottom": "1px solid #ddd", "padding": "4px 8px", "textAlign": "left"}


ROW_STYLE = {"display": "flex", "flexWrap": "wrap", "gap": "8px", "margin": 0}
"""Row layout that holds without the Bootstrap stylesheet too."""


def status_badge(status: str, prefix: str) -> html.Span:
    """A coloured status label; its id is ``{prefix}-status`` (page-prefixed)."""
    return html.Span(
        status,
        id=f"{prefix}-status",
        className=f"vigil-status vigil-status-{status.lower()}",
        style={
            "backgroundColor": STATUS_COLORS.get(status, "#8a8a8a"),
            "color": "white",
            "borderRadius": "4px",
            "padding": "1px 6px",
            "fontSize": "12px",
        },
    )


def badge_cell(status: str) -> html.Td:
    return html.Td(
        html.Span(status, style={"color": STATUS_COLORS.get(status, "#333"), "fontWeight": "bold"}),
        style=CELL_STYLE,
    )


def header(columns: Sequence[str]) -> html.Thead:
    return html.Thead(html.Tr([html.Th(c, style=CELL_STYLE) for c in columns]))


def empty_row(columns: Sequence[str], message: str) -> html.Tr:
    """A single row spanning ``columns`` that says ``message`` (a table with nothing to list)."""
    return html.Tr(html.Td(message, colSpan=len(columns), style={**CELL_STYLE, "color": "#888"}))


def error_banner(message: str, component_id: str) -> html.Div:
    """A visible error line (controller unreachable, bad answer)."""
    return html.Div(
        message, id=component_id, className="vigil-error", style={"color": "#a33", "padding": "6px 0"}
    )


GRID_DEFAULT_COL = {"sortable": True, "filter": True, "resizable": True, "minWidth": 80}


def grid(component_id: str, columns: list[dict[str, Any]], *, row_id: str | None = None,
         highlight: str | None = None, auto_height: bool = True, height: str = "360px") -> Any:
    """A sortable, filterable AG Grid. ``row_id``: the field that identifies a row (rows keep their
    identity across refreshes); ``highlight``: a JavaScript condition on ``params.data`` whose rows are
    drawn red and bold (the stragglers, the invalid checkpoints); ``auto_height``: every row rendered
    (small tables), else a scrolling grid ``height`` high."""
    import dash_ag_grid as dag

    options: dict[str, Any] = {"animateRows": False}
    if auto_height:
        options["domLayout"] = "autoHeight"
    kwargs: dict[str, Any] = {}
    if row_id is not None:
        kwargs["getRowId"] = f"params.data.{row_id}"
    if highlight is not None:
        kwargs["getRowStyle"] = {"styleConditions": [
            {"condition": highlight, "style": {"backgroundColor": "#fde0e0", "fontWeight": "bold"}}]}
    return dag.AgGrid(
        id=component_id,
        columnDefs=columns,
        rowData=[],
        defaultColDef={**GRID_DEFAULT_COL, "flex": 1},
        dashGridOptions=options,
        style={"width": "100%"} if auto_height else {"width": "100%", "height": height},
        **kwargs,
    )
