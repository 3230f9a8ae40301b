"""The sign-in page's callback: check a pasted token and start a session with it."""

from __future__ import annotations

from typing import Any

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, State

from dashboard import auth
from dashboard.context import FETCH_ERRORS, describe_error, open_client
from dashboard.pages.signin.layout import TOKEN_MAX, status
from dashboard.registry import CallbackSet
from vigil.contract.client import ApiError

callback = CallbackSet()
"""Declares this page's callbacks, as ``@dash.callback`` would; the page's ``register`` puts them
on an app."""


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
        return ("", alert, status(identity), *auth.header_state(identity))

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

