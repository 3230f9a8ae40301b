"""The jobs list's table: one row per job (``data-job-id``), its id linking to the job's page.

Built by a pure function from wire-schema objects, unit-tested without a server.
"""

from __future__ import annotations

from dash import dcc, html

from dashboard.format import fmt_float, fmt_progress, fmt_time, fmt_workers
from dashboard.tables import CELL_STYLE, TABLE_STYLE, badge_cell, empty_row, header
from vigil.contract.schemas import JobsPublic

JOB_COLUMNS = ("id", "name", "status", "optimizer", "workers", "step", "last loss", "created")


def jobs_table(jobs: JobsPublic, link_prefix: str, table_id: str = "jobs-table-body") -> html.Table:
    """The jobs list: one row per job, newest first as the controller returns them.

    ``link_prefix`` is the dashboard's URL prefix (``/dashboard/`` when mounted); each job id
    links to ``{link_prefix}jobs/{id}``.
    """
    rows = [
        html.Tr(
            [
                html.Td(dcc.Link(job.id, href=f"{link_prefix}jobs/{job.id}"), style=CELL_STYLE),
                html.Td(job.name, style=CELL_STYLE),
                badge_cell(job.status.value),
                html.Td(job.spec.optimizer.kind, style=CELL_STYLE),
                html.Td(fmt_workers(job), style=CELL_STYLE),
                html.Td(fmt_progress(job), style=CELL_STYLE),
                html.Td(fmt_float(job.last_loss), style=CELL_STYLE),
                html.Td(fmt_time(job.created_at), style=CELL_STYLE),
            ],
            className="vigil-job-row",
            **{"data-job-id": job.id},
        )
        for job in jobs.data
    ]
    if not rows:
        rows = [empty_row(JOB_COLUMNS, "no jobs yet")]
    return html.Table([header(JOB_COLUMNS), html.Tbody(rows, id=table_id)], style=TABLE_STYLE)
