"""The job page's header and detail panels: the header with its live vitals (:class:`Vitals`: ETA,
restarts, ranks, the incident under way), the goodput summary, what a click on a loss-curve marker
shows, and the line about the selected rank. Pure functions from wire-schema objects to Dash
components, like :mod:`dashboard.tables`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dash import html

from dashboard.format import (
    DASH,
    fmt_bytes,
    fmt_duration,
    fmt_float,
    fmt_progress,
    fmt_time,
    fmt_workers,
    incident_line,
)
from dashboard.pages.job.incidents import evidence_table
from dashboard.tables import status_badge
from vigil.contract.schemas import (
    DEFAULT_ENTRYPOINT,
    CheckpointPublic,
    GoodputPublic,
    IncidentPublic,
    JobPublic,
    RankSummary,
)


@dataclass(frozen=True)
class Vitals:
    """What the job page's header says about a job beyond its record (all optional)."""

    eta_s: float | None = None
    """Seconds to the last step at the recent pace."""
    restarts: int | None = None
    """Restarts seen so far."""
    incident: IncidentPublic | None = None
    """The incident under way (OPEN or ACTING), if any."""
    ranks: int | None = None
    """Ranks that reported recently."""


def _vital(label: str, value: Any, component_id: str) -> html.Span:
    return html.Span([html.B(f"{label}: "), html.Span(value, id=component_id)], style={"marginRight": "18px"})


def job_header(job: JobPublic, vitals: Vitals | None = None) -> list[Any]:
    """The job page's header: name and status, progress bar, ETA, restarts, the incident under way,
    then a one-line summary of the spec and timings."""
    v = vitals or Vitals()
    spec = job.spec
    m = spec.model
    done = -1 if job.last_step is None else job.last_step
    incident: Any = DASH
    if v.incident is not None:
        incident = html.Span(incident_line(v.incident), style={"color": "#d62728", "fontWeight": "bold"})
    status_line = html.Div(
        [
            html.Span(
                [html.Progress(value=str(max(done + 1, 0)), max=str(max(spec.steps, 1)), id="job-detail-progress",
                               style={"width": "180px", "verticalAlign": "middle", "marginRight": "6px"}),
                 html.Span(fmt_progress(job), id="job-detail-step")],
                style={"marginRight": "18px"},
            ),
            _vital("ETA", DASH if job.status.is_terminal() else fmt_duration(v.eta_s), "job-detail-eta"),
            _vital("restarts", DASH if v.restarts is None else str(v.restarts), "job-detail-restarts"),
            _vital("ranks", DASH if v.ranks is None else str(v.ranks), "job-detail-ranks"),
            _vital("incident", incident, "job-detail-incident"),
        ],
        id="job-detail-vitals",
        style={"margin": "4px 0 6px 0"},
    )
    facts = [
        ("id", job.id),
        ("entry point", spec.entrypoint),
        ("optimizer", f"{spec.optimizer.kind} (lr {fmt_float(spec.optimizer.lr, 3)})"),
        ("workers", fmt_workers(job)),
        ("step", fmt_progress(job)),
        ("last loss", fmt_float(job.last_loss)),
    ]
    if spec.entrypoint == DEFAULT_ENTRYPOINT or spec.entrypoint.startswith("gpt_train:"):
        # The bundled GPT example's own settings; other code has its `config` instead.
        facts += [("batch", f"{spec.batch_size} x {m.context} bytes per rank"),
                  ("model", f"{m.n_layer} layers, {m.n_head} heads, d_model {m.d_model}")]
    if spec.working_dir:
        facts.append(("code", spec.working_dir[:19]))
    facts += [
        ("recovery", spec.recovery.policy.value),
        ("created", fmt_time(job.created_at)),
        ("started", fmt_time(job.started_at)),
        ("finished", fmt_time(job.finished_at)),
    ]
    out: list[Any] = [
        html.H2([job.name, " ", status_badge(job.status.value, "job-detail")], id="job-detail-title"),
        status_line,
        html.Div(
            [html.Span([html.B(f"{k}: "), v_, "  "], style={"marginRight": "12px"}) for k, v_ in facts],
            id="job-detail-facts",
            style={"fontSize": "13px", "color": "#444"},
        ),
    ]
    if job.message:
        out.append(html.Div(job.message, id="job-detail-message", style={"color": "#a33"}))
    return out


def job_summary(job: JobPublic) -> list[Any]:
    """Header of the job page without the live vitals (:func:`job_header`)."""
    return job_header(job)


def goodput_summary(gp: GoodputPublic | None) -> html.Div:
    """The ETTR as a big number (``job-detail-ettr``), then productive and lost time in words."""
    if gp is None:
        return html.Div("no goodput yet", id="job-detail-goodput-text", style={"color": "#888"})
    ettr = DASH if gp.ettr is None else f"{gp.ettr:.3f}"
    lost = sorted(((c, v) for c, v in gp.lost_s.items() if v > 0), key=lambda cv: -cv[1])
    return html.Div(
        [
            html.Div([html.Span("ETTR ", style={"fontSize": "18px"}),
                      html.Span(ettr, id="job-detail-ettr", style={"fontSize": "36px", "fontWeight": "bold"})]),
            html.Div(f"productive {fmt_duration(gp.productive_s)} of {fmt_duration(gp.wall_s)} wall; "
                     f"{gp.restarts} restart{'s' if gp.restarts != 1 else ''}, {gp.steps_rerun} steps re-run",
                     id="job-detail-goodput-text"),
            html.Ul([html.Li(f"{c.replace('_', ' ')}: {fmt_duration(v)} ({100 * v / gp.wall_s:.1f}%)")
                     for c, v in lost if gp.wall_s > 0], id="job-detail-lost"),
        ],
    )


def marker_detail(marker: Sequence[Any] | None, incident: IncidentPublic | None = None,
                  checkpoint: CheckpointPublic | None = None) -> Any:
    """What a click on a marker of the loss curve shows: the marker (``[kind, step, label, ref, ts]``),
    and the incident or checkpoint it refers to."""
    if not marker:
        return html.Div("click a marker on the loss curve for its details", style={"color": "#888"})
    kind, step, label, _ref, ts = (list(marker) + [None] * 5)[:5]
    when = fmt_time(datetime.fromtimestamp(float(ts), UTC)) if isinstance(ts, int | float) else DASH
    out: list[Any] = [html.Div([html.B(f"{kind} at step {step}: "), label, f" ({when})"])]
    if incident is not None:
        out.append(html.Div([html.B("incident: "), incident_line(incident), " · action: ",
                             incident.action or "none yet"]))
        out.append(evidence_table(incident.evidence))
    if checkpoint is not None:
        out.append(html.Div([html.B("checkpoint: "), f"step {checkpoint.step}, {fmt_bytes(checkpoint.bytes)}, ",
                             "valid" if checkpoint.valid else "INVALID", f", {checkpoint.path}"]))
    return html.Div(out, className="vigil-marker-detail")


def rank_detail(rank: int | None, summary: RankSummary | None = None, node_id: str | None = None) -> Any:
    """One line about the selected rank: its node and how it compares with the median rank."""
    if rank is None:
        return html.Span("no rank selected: click a rank (heatmap row, slowest ranks, a line) for its breakdown",
                         style={"color": "#888"})
    parts = [html.B(f"rank {rank}")]
    node = (summary.node_id if summary is not None else None) or node_id
    if node:
        parts.append(f" on {node}")
    if summary is not None:
        parts.append(f": mean step {fmt_float(summary.step_time_mean_s, 3)} s, "
                     f"{summary.vs_median:.2f}x the median rank")
    return html.Span(parts)
