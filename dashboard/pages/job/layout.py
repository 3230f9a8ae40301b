"""The job page's skeleton: header (summary, actions), the rank selector, and one tab per question
(:data:`TABS`), each with its graphs and grids, empty until the callbacks fill them."""

from __future__ import annotations

from typing import Any

import dash_bootstrap_components as dbc
from dash import dcc, html

from dashboard.actions import job_actions_panel
from dashboard.context import current_config
from dashboard.figures.base import graph
from dashboard.pages.job.panels import goodput_summary, marker_detail, rank_detail
from dashboard.pages.job.tables import (
    CHECKPOINT_COLUMNS,
    COLLECTIVE_COLUMNS,
    EVENT_GRID_COLUMNS,
    LOST_COLUMNS,
    SLOWEST_COLUMNS,
)
from dashboard.tables import ROW_STYLE, grid

TABS = ("training", "ranks", "breakdown", "communication", "incidents", "checkpoints", "goodput", "events")
_COL = {"flex": "1 1 520px", "minWidth": 0}


def _graph(name: str, title: str, height: str = "380px") -> dcc.Graph:
    return graph(f"job-detail-{name}", title, height)


def _row(*children: Any) -> dbc.Row:
    return dbc.Row([dbc.Col(c, style=_COL) for c in children], style=ROW_STYLE)


def _tab(label: str, value: str, children: list[Any]) -> dcc.Tab:
    return dcc.Tab(label=label, value=value, id=f"job-detail-tab-{value}",
                   children=html.Div(children, style={"paddingTop": "8px"}))


def _tabs() -> dcc.Tabs:
    return dcc.Tabs(
        id="job-detail-tabs",
        value="training",
        children=[
            _tab("Training", "training", [
                _row(_graph("loss", "Loss"), _graph("throughput", "Throughput")),
                html.Div(id="job-detail-marker-detail", children=marker_detail(None), style={"padding": "6px"}),
            ]),
            _tab("Ranks", "ranks", [
                _row(_graph("step-time", "Step time"), _graph("heatmap", "Step time per rank")),
                html.Div(_graph("rank-lines", "Step time per rank"), id="job-detail-rank-lines-box",
                         style={"display": "none"}),
                html.H4("Slowest ranks"),
                grid("job-detail-slowest", SLOWEST_COLUMNS, row_id="rank", highlight="params.data.flag"),
                _graph("rank-breakdown", "Step breakdown of the selected rank", height="320px"),
                _graph("rank-lost", "Seconds lost to slow ranks", height="320px"),
                grid("job-detail-rank-lost-table", LOST_COLUMNS, row_id="rank"),
            ]),
            _tab("Step breakdown", "breakdown", [
                _row(_graph("breakdown-step", "Step breakdown"), _graph("breakdown-rank", "Time per rank")),
            ]),
            _tab("Communication", "communication", [
                html.Div(id="job-detail-coll-note"),
                _row(_graph("coll-time", "Time in collectives"), _graph("coll-wait", "Wait vs transfer")),
                _row(_graph("coll-bandwidth", "Achieved bandwidth"), _graph("coll-bits", "Bits per parameter")),
                grid("job-detail-collectives", COLLECTIVE_COLUMNS, row_id="kind"),
            ]),
            _tab("Incidents", "incidents", [
                _graph("incident-timeline", "Incidents", height="260px"),
                html.Div(id="job-detail-incidents"),
            ]),
            _tab("Checkpoints", "checkpoints", [
                _graph("checkpoint-figure", "Checkpoints", height="320px"),
                grid("job-detail-checkpoints", CHECKPOINT_COLUMNS, row_id="id", highlight="params.data.valid === 'NO'"),
            ]),
            _tab("Goodput", "goodput", [
                _row(html.Div(id="job-detail-goodput", children=goodput_summary(None)),
                     _graph("goodput-figure", "Goodput")),
            ]),
            _tab("Events", "events", [grid("job-detail-events", EVENT_GRID_COLUMNS, row_id="id")]),
        ],
    )


def layout(job_id: str | None = None, **kwargs: Any) -> html.Div:
    """Skeleton of the page of ``job_id`` (called with no id by Dash to validate callbacks)."""
    return html.Div(
        [
            dcc.Store(id="job-detail-id", data=job_id),
            dcc.Store(id="job-detail-cursor", data=None),
            dcc.Interval(id="job-detail-interval", interval=current_config().refresh_ms, n_intervals=0),
            html.Div(
                id="job-detail-header",
                children=[
                    html.Div(id="job-detail-summary", children=html.H2(f"Job {job_id or ''}")),
                    html.Div(job_actions_panel(job_id), id="job-detail-actions"),
                ],
            ),
            html.Div(id="job-detail-error"),
            html.Div(
                id="job-detail-body",
                children=[
                    html.Div(
                        [html.B("rank: "),
                         dcc.Input(id="job-detail-rank", type="number", min=0, step=1, debounce=True,
                                   placeholder="all", style={"width": "90px", "marginRight": "10px"}),
                         html.Span(id="job-detail-rank-info", children=rank_detail(None))],
                        style={"margin": "4px 0"},
                    ),
                    _tabs(),
                ],
            ),
        ]
    )
