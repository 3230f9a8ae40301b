"""Job detail as a diagnosis: a header (status, progress, ETA, restarts, the incident under way), then
one tab per question:

* **Training**: loss (train and validation) and throughput against step, with the job's restarts,
  evictions, incidents, checkpoints and faults marked on the x axis (click one: its details);
* **Ranks**: step time percentiles over ranks (p50..p90 band, max with its rank), the binned
  rank x step heatmap, the slowest ranks (stragglers highlighted), one line per rank for jobs of at
  most 8 ranks, and the seconds each rank cost the job (ranked bar by node, grid); click a rank for its
  breakdown;
* **Step breakdown**: data / forward+backward / optimizer / communication / waiting, stacked per
  step (job-wide or the selected rank) and per rank;
* **Communication**: per kind of collective, p50/max time, wait vs transfer, achieved bandwidth,
  and wire bits per parameter per step by tag; kinds whose bytes are estimated (captured from torch's
  Flight Recorder) marked ``(est.)``, with a line saying why;
* **Incidents**: each with its timeline, action and evidence; a hang's place in the collectives (who
  waits where, who never entered; one row per rank) above its grouped py-spy stacks with the odd
  rank's against the majority's;
* **Checkpoints**: valid / invalid (and why), size, which one each restart restored;
* **Goodput**: productive time against the time lost per cause, and the ETTR;
* **Events**: the job's recent events.

Refreshing: every tick, :func:`~dashboard.pages.job.callbacks.refresh_job` reads the job and the
overview's steps *after* the newest one drawn (``since_step``, the page's cursor in
``job-detail-cursor``) and extends the line figures with ``dash.Patch`` (a full rebuild on first load,
after a restart, or when they grew too long: :mod:`dashboard.pages.job.cursor`,
:mod:`dashboard.pages.job.figures.overview`). :func:`~dashboard.pages.job.callbacks.refresh_tab` then
fetches and rebuilds the open tab's views only (heavy reads, the heatmap, step breakdowns,
collectives, only while their tab is open). Polling stops once the job is terminal; a job the controller does not know (404) shows "job not found".

The page's modules: ``layout.py`` (the skeleton and its tabs), ``callbacks.py`` (the polling and click
callbacks), ``tabs.py`` (what each tab fetches and builds), ``cursor.py`` (incremental refresh),
``joins.py`` and ``clicks.py`` (pure logic), ``panels.py``, ``tables.py``, ``incidents.py``,
``collectives_view.py`` (components) and ``figures/`` (one module per tab).

Component ids start with ``job-detail-``. ``job-detail-actions`` in the header holds the job's action
buttons (:func:`dashboard.actions.job_actions_panel`: cancel, recover, inject a fault; a signed-in user
or admin only), outside what the polling callback re-renders, so an open confirmation survives a refresh.
"""

from __future__ import annotations

import dash

from dashboard.pages.job.callbacks import callback
from dashboard.pages.job.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(
        __name__,
        path_template="/jobs/<job_id>",
        name="Job",
        title=lambda job_id=None, **_: f"Vigil - job {job_id}" if job_id else "Vigil - job",
        order=1,
        layout=layout,
    )
    callback.register(app)
