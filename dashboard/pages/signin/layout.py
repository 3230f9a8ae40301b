"""The sign-in page's skeleton: the token field and the session's state."""

from __future__ import annotations

from typing import Any

import dash_bootstrap_components as dbc
from dash import html

from dashboard import auth

TOKEN_MAX = 512
"""Longer input is not a Vigil token (``vgl_`` + 43 characters); refused without asking the controller."""


def status(identity: auth.Identity | None) -> Any:
    if identity is None:
        return html.Span("Not signed in: the dashboard is read-only.", className="text-muted")
    who = f" ({identity.name})" if identity.name else ""
    can = "may act (cancel, recover, evict, inject faults)" if auth.may_act(identity) else "may only read"
    return html.Span([html.B(identity.label), who, f": {can}."])


def layout(**kwargs: Any) -> html.Div:
    """The token field and the session's state."""
    return html.Div(
        [
            html.H2("Sign in"),
            html.P(
                "Paste a Vigil token (vgl_…) of a user or an admin to act from the dashboard. The token "
                "stays on the dashboard's server for this browser session; the browser keeps only a session "
                "cookie. Without signing in, the dashboard is read-only.",
                className="text-muted",
            ),
            html.Div(status(auth.current_identity()), id="signin-status", className="mb-2"),
            dbc.InputGroup(
                [
                    dbc.Input(id="signin-token", type="password", placeholder="vgl_…", autocomplete="off",
                              debounce=False, value="", maxLength=TOKEN_MAX),
                    dbc.Button("Sign in", id="signin-submit", color="primary", n_clicks=0),
                ],
                style={"maxWidth": "640px"},
            ),
            html.Div(id="signin-message", className="mt-2"),
        ]
    )
