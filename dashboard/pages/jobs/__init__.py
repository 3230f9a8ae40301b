"""Jobs list (``/``): every job with its status, optimizer, size, progress and last loss.

Component ids start with ``jobs-``.
"""

from __future__ import annotations

import dash

from dashboard.pages.jobs.callbacks import callback
from dashboard.pages.jobs.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(__name__, path="/", name="Jobs", title="Vigil - jobs", order=0, layout=layout)
    callback.register(app)
