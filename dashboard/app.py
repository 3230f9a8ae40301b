"""The Vigil dashboard: a multi-page Plotly Dash app that reads the controller's REST API only.

Two ways to run it:

* **Mounted in the controller** (the default deployment)::

      dash_app = create_dash_app(api_base_url, token)            # requests prefix "/dashboard/"
      app.mount("/dashboard", a2wsgi.WSGIMiddleware(dash_app.server))

  Starlette's mount strips ``/dashboard`` from the path it hands to the WSGI app (it becomes the
  WSGI ``SCRIPT_NAME``), so Dash's own routes live at ``/`` (``routes_pathname_prefix="/"``),
  while the browser must prefix every request with ``/dashboard/``
  (``requests_pathname_prefix="/dashboard/"``).

* **Standalone**: ``vigil dashboard --controller URL --port 8050`` (or
  ``python -m dashboard ...``) calls :func:`main`, which serves the app at ``/``.

The pages live in ``dashboard/pages`` (one folder per page); :func:`create_dash_app` registers each of
:data:`PAGES` and its callbacks on the app it builds. This module must not import torch, ray or the
trainer; a test checks it.

The app reads the controller with its own token, read-only. A person may sign in (``/signin``) with
their own token, which the server keeps (:mod:`dashboard.auth`): the navigation bar shows
"read-only" or "signed in as <role>", and the actions (:mod:`dashboard.actions`) are for a signed-in
user or admin only. Styles: Bootstrap (``assets/bootstrap.min.css``, served by the app itself, since
the browser may have no internet) and AG Grid's own theme; cell renderers in ``assets/vigil_grid.js``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Sequence

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, dcc, html

from dashboard import actions, auth
from dashboard.context import CONFIG_KEY, FETCH_ERRORS, REFRESH_MS, DashboardConfig, open_client
from dashboard.pages import compare, events, job, jobs, node, nodes, signin
from vigil.contract.settings import ENV_TOKEN

log = logging.getLogger(__name__)

PAGES = (jobs, job, nodes, node, compare, events, signin)
"""The dashboard's pages (``dashboard/pages/<page>/``), each registered by its ``register(app)``."""
MOUNT_PREFIX = "/dashboard/"
"""Where the controller mounts the dashboard."""
NAV_LINKS = (("Jobs", ""), ("Nodes", "nodes"), ("Compare", "compare"), ("Events", "events"))


def _normalise_prefix(prefix: str) -> str:
    if not prefix.startswith("/"):
        prefix = "/" + prefix
    if not prefix.endswith("/"):
        prefix += "/"
    return prefix


def _shell(prefix: str) -> html.Div:
    """Navigation bar (pages, sign-in badge, sign in / sign out) around Dash's page container.

    A function of the request (Dash calls it for every page load): the badge starts right for the
    browser's session, and :func:`_register_auth_callbacks` keeps it right afterwards.
    """
    text, color, signin_style, signout_style = auth.header_state(auth.current_identity())
    links = [
        dcc.Link(label, href=prefix + path, id=f"app-nav-{label.lower()}", className="nav-link")
        for label, path in NAV_LINKS
    ]
    nav = html.Nav(
        [
            html.Span("Vigil", className="navbar-brand fw-bold"),
            html.Div(links, className="navbar-nav me-auto flex-row gap-2 vigil-nav"),
            html.Div(
                [
                    dbc.Badge(text, id="app-auth-badge", color=color, className="me-2"),
                    dcc.Link("Sign in", href=prefix + "signin", id="app-nav-signin", className="nav-link",
                             style=signin_style),
                    dbc.Button("Sign out", id="app-signout", size="sm", color="outline-secondary", n_clicks=0,
                               style=signout_style),
                ],
                className="d-flex align-items-center",
            ),
        ],
        className="navbar navbar-light bg-light border-bottom px-3 mb-2",
    )
    return html.Div([nav, html.Div(dash.page_container, className="px-3")])


def _register_auth_callbacks(app: dash.Dash) -> None:
    """The badge follows the session: re-checked against the controller on every navigation (a token
    revoked since sign-in signs the session out), cleared by "Sign out"."""
    outputs = [Output(i, p) for i, p in auth.HEADER_OUTPUTS]

    @app.callback(*outputs, Input("_pages_location", "pathname"))
    def refresh_auth(_pathname: str | None) -> tuple[object, ...]:
        if auth.current_identity() is not None:
            # With the session's token: a 401 (revoked, expired) signs the session out. Any other
            # failure (the controller is away) keeps it; the pages say what is wrong.
            with contextlib.suppress(*FETCH_ERRORS), open_client() as client:
                client.whoami()
        return auth.header_state(auth.current_identity())

    @app.callback(
        *[Output(i, p, allow_duplicate=True) for i, p in auth.HEADER_OUTPUTS],
        Input("app-signout", "n_clicks"),
        prevent_initial_call=True,
    )
    def sign_out(n_clicks: int | None) -> tuple[object, ...]:
        if n_clicks:
            auth.sign_out()
        return auth.header_state(auth.current_identity())


def create_dash_app(
    api_base_url: str,
    token: str | None = None,
    requests_pathname_prefix: str = MOUNT_PREFIX,
    *,
    refresh_ms: int = REFRESH_MS,
) -> dash.Dash:
    """Build the dashboard app for the controller at ``api_base_url``.

    ``requests_pathname_prefix`` is the URL path under which browsers reach the app:
    ``"/dashboard/"`` when the controller mounts ``app.server`` at ``/dashboard`` (the default),
    ``"/"`` when it runs standalone. Dash's server-side routes always live at ``/`` of the WSGI
    app, since the mount strips its own prefix. ``token`` is sent as a bearer token with every
    API call of a browser that is not signed in (it never acts: see :mod:`dashboard.auth`);
    ``refresh_ms`` is how often the pages poll. The session cookie is signed with
    ``$VIGIL_DASHBOARD_SECRET``, else a random key of this process.
    """
    if not api_base_url:
        raise ValueError("api_base_url is required")
    if refresh_ms < 100:
        raise ValueError(f"refresh_ms must be >= 100, got {refresh_ms}")
    prefix = _normalise_prefix(requests_pathname_prefix)
    app = dash.Dash(
        "dashboard",
        use_pages=True,
        pages_folder="",  # the pages are registered below, not found by walking a folder
        requests_pathname_prefix=prefix,
        routes_pathname_prefix="/",
        title="Vigil",
        update_title=None,
        serve_locally=True,  # the browser may have no internet; Dash serves its own JS bundles
    )
    app.server.config[CONFIG_KEY] = DashboardConfig(
        api_base_url=api_base_url.rstrip("/"), token=token, prefix=prefix, refresh_ms=refresh_ms
    )
    for page in PAGES:  # after the app and its config exist (dash.register_page needs the app)
        page.register(app)
    auth.configure_server(app.server, cookie_path=prefix)
    _register_auth_callbacks(app)
    actions.register_callbacks(app)
    app.layout = lambda: _shell(prefix)
    return app


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from vigil.contract.settings import get_settings  # cheap (pydantic-settings only)

    p = argparse.ArgumentParser(prog="vigil dashboard", description="Serve the Vigil dashboard on its own.")
    p.add_argument("--controller", default=get_settings().controller_url, help="controller base URL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8050, help="port to bind")
    p.add_argument(
        "--token",
        default=os.environ.get(ENV_TOKEN),
        help="bearer token for the controller (env VIGIL_TOKEN)",
    )
    p.add_argument("--refresh-ms", type=int, default=REFRESH_MS, help="how often pages poll the controller")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``vigil dashboard --controller URL [--host H] [--port 8050] [--token T]``: serve at ``/``."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_dash_app(
        args.controller, token=args.token, requests_pathname_prefix="/", refresh_ms=args.refresh_ms
    )
    log.info("dashboard for %s on http://%s:%d/", args.controller, args.host, args.port)
    app.run(host=args.host, port=args.port, debug=False)
    return 0
