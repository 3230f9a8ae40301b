"""Events (``/events``): the controller's most recent events (job transitions, incidents, recovery
actions).

Component ids start with ``events-``.
"""

from __future__ import annotations

import dash

from dashboard.pages.events.callbacks import callback
from dashboard.pages.events.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(__name__, path="/events", name="Events", title="Vigil - events", order=4, layout=layout)
    callback.register(app)
