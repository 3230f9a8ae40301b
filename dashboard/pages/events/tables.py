"""The events list's table: one row per event (``data-event-id``), job ids linking to the job's page.

Built by a pure function from wire-schema objects, unit-tested without a server.
"""

from __future__ import annotations

from dash import dcc, html

from dashboard.format import DASH, fmt_time
from dashboard.tables import CELL_STYLE, TABLE_STYLE, empty_row, header
from vigil.contract.schemas import EventsPublic

EVENT_COLUMNS = ("time", "kind", "job", "node", "message")


def events_table(events: EventsPublic, link_prefix: str) -> html.Table:
    """Events, in the order the controller returns them (newest first); job ids link to the job."""
    rows = [
        html.Tr(
            [
                html.Td(fmt_time(e.ts), style=CELL_STYLE),
                html.Td(e.kind, style=CELL_STYLE),
                html.Td(
                    dcc.Link(e.job_id, href=f"{link_prefix}jobs/{e.job_id}") if e.job_id else DASH,
                    style=CELL_STYLE,
                ),
                html.Td(e.node_id or DASH, style=CELL_STYLE),
                html.Td(e.message, style=CELL_STYLE),
            ],
            className="vigil-event-row",
            **{"data-event-id": str(e.id)},
        )
        for e in events.data
    ]
    if not rows:
        rows = [empty_row(EVENT_COLUMNS, "no events")]
    return html.Table([header(EVENT_COLUMNS), html.Tbody(rows)], style=TABLE_STYLE)
