"""The dashboard, mounted in the controller's app under ``/dashboard``: the :data:`controller.app.Mount`
that ``vigil controller`` passes to :func:`controller.app.create_app` (the server imports no user
interface; this composition root wires the two together)."""

from __future__ import annotations

from a2wsgi import WSGIMiddleware
from fastapi import FastAPI

from controller.auth import mint_internal_token
from dashboard.app import MOUNT_PREFIX, create_dash_app
from vigil.contract.schemas import Role
from vigil.contract.settings import Settings


def mount_dashboard(app: FastAPI, settings: Settings) -> str:
    """Mount the Dash app at ``/dashboard`` (``MOUNT_PREFIX``) of ``app``; returns its home, where ``/`` redirects."""
    # The dashboard's callbacks run here, server side: its token never reaches a browser. No CORS
    # middleware is installed, so no other origin may read the API or the dashboard's answers.
    token = settings.dashboard_token
    if token is None and settings.auth_enabled and settings.dashboard_open_reads:
        token = mint_internal_token(app, Role.VIEWER, "dashboard (mounted)")
    dash_app = create_dash_app(settings.controller_url, token=token, requests_pathname_prefix=MOUNT_PREFIX)
    app.mount(MOUNT_PREFIX.rstrip("/"), WSGIMiddleware(dash_app.server))
    return MOUNT_PREFIX
