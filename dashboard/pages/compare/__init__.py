"""Compare jobs: loss against step, against wall time and against bits sent, one trace per job.

Pick jobs in the multi-select (or open ``/compare?jobs=a,b``); each job's curve is labelled
``name (optimizer)``. Per-step loss, time and wire bytes come from the job overview
(``GET /jobs/{id}/overview``); bits sent are the cumulative wire bytes x 8
(:func:`dashboard.pages.compare.figures.cumulative_bits`). ``compare-link`` is a link to the current
selection. Component ids start with ``compare-``.
"""

from __future__ import annotations

import dash

from dashboard.pages.compare.callbacks import callback
from dashboard.pages.compare.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(__name__, path="/compare", name="Compare", title="Vigil - compare", order=3, layout=layout)
    callback.register(app)
