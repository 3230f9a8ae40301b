"""Sign in: paste a Vigil token to act (cancel, recover, evict, inject faults) as its owner.

The token is checked against the controller (``GET /api/v1/whoami``) and kept on the server
(:mod:`dashboard.auth`); the browser gets only a session cookie. The callback clears the input the
token was pasted into and never sends the token back. Sign out from the navigation bar.
Component ids start with ``signin-``.
"""

from __future__ import annotations

import dash

from dashboard.pages.signin.callbacks import callback
from dashboard.pages.signin.layout import layout


def register(app: dash.Dash) -> None:
    """Register the page and its callbacks on ``app``."""
    dash.register_page(__name__, path="/signin", name="Sign in", title="Vigil - sign in", order=9, layout=layout)
    callback.register(app)
