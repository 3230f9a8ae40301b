"""Sign in: paste a Vigil token to act (cancel, recover, evict, inject faults) as its owner.

The token is checked against the controller (``GET /api/v1/whoami``) and kept on the server
(:mod:`dashboard.auth`); the browser gets only a session cookie. The callback clears the input the
token was pasted into and never sends the token back. Sign out from the navigation bar.
Component ids start with ``signin-``.
"""

from __future__ import annotations

from typing import Any

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, State, callback, html

from controller.client import ApiError
from dashboard import auth
from dashboard.context import FETCH_ERRORS, describe_error, open_client

dash.register_page(__name__, path="/signin", name="Sign in", title="Vigil - sign in", order=9)

TOKEN_MAX = 512
"""Longer input is not a Vigil token (``vgl_`` + 43 characters); refused without asking the controller."""


def _status(identity: auth.Identity | None) -> Any:
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
            html.Div(_status(auth.current_identity()), id="signin-status", className="mb-2"),
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


@callback(
    Output("signin-token", "value"),
    Output("signin-message", "children"),
    Output("signin-status", "children"),
    *[Output(i, p, allow_duplicate=True) for i, p in auth.HEADER_OUTPUTS],
    Input("signin-submit", "n_clicks"),
    Input("signin-token", "n_submit"),
    State("signin-token", "value"),
    prevent_initial_call=True,
)
def submit(_clicks: int | None, _submits: int | None, token: str | None) -> tuple[Any, ...]:
    """Check the pasted token and start a session with it; the answer never holds the token."""
    if not any(t.get("value") for t in dash.ctx.triggered):  # the page mounting, not a click or Enter
        return (dash.no_update,) * (3 + len(auth.HEADER_OUTPUTS))
    token = (token or "").strip()

    def answer(message: Any, ok: bool) -> tuple[Any, ...]:
        identity = auth.current_identity()
        alert = dbc.Alert(message, id="signin-message-text", color="success" if ok else "danger",
                          className="py-1 px-2")
        return ("", alert, _status(identity), *auth.header_state(identity))

    if not token:
        return answer("Paste a token first.", False)
    if len(token) > TOKEN_MAX or any(c.isspace() for c in token):
        return answer("That is not a Vigil token.", False)
    try:
        with open_client(token=token) as client:
            me = client.whoami()
        identity = auth.sign_in(token, me)
    except ApiError as exc:
        reason = {401: "the controller does not know this token (unknown, expired or revoked)",
                  403: "this token may not use the dashboard"}.get(exc.status_code, describe_error(exc))
        return answer(f"Not signed in: {reason}.", False)
    except auth.SignInError as exc:
        return answer(f"Not signed in: {exc}.", False)
    except FETCH_ERRORS as exc:
        return answer(f"Not signed in: {describe_error(exc)}.", False)
    return answer(f"Signed in as {identity.role.value}.", True)
