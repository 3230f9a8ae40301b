"""Per-app configuration of the dashboard and the controller client its callbacks use.

The pages' callbacks are plain functions of the page's inputs, but the controller URL, the token and
the URL prefix belong to one app: several apps may live in one process (tests; the controller
mounting one while another runs standalone). So each app stores a :class:`DashboardConfig` in its
Flask server's config, and callbacks read the one of the app serving the current request.

Callbacks run on the server's worker threads; each opens its own :class:`VigilClient` (an httpx
client is cheap to create, and one shared across threads would need locking for no gain). The
client carries the token of the person signed in to this browser session (:mod:`dashboard.auth`),
else the app's own (read-only) token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import flask
import httpx

from dashboard import auth
from vigil.contract.client import ApiError, VigilClient

CONFIG_KEY = "VIGIL_DASHBOARD"
REFRESH_MS = 2000
"""How often the pages poll the controller."""
CLIENT_TIMEOUT_S = 5.0
"""Per-request timeout; shorter than a few refresh periods so a stuck controller shows up as an error."""


@dataclass(frozen=True)
class DashboardConfig:
    """What the callbacks of one dashboard app need to know."""

    api_base_url: str
    """Base URL of the controller (without ``/api/v1``)."""
    token: str | None
    """Bearer token sent to the controller, or ``None``."""
    prefix: str
    """The app's ``requests_pathname_prefix``: the URL path under which browsers reach it; ends in ``/``."""
    refresh_ms: int = REFRESH_MS

    def href(self, path: str) -> str:
        """Browser URL of a dashboard path: ``href("/jobs/x")`` is ``/dashboard/jobs/x`` when mounted."""
        return self.prefix + path.lstrip("/")


def current_config() -> DashboardConfig:
    """The configuration of the app serving the current request (call only inside a request)."""
    cfg = flask.current_app.config[CONFIG_KEY]
    assert isinstance(cfg, DashboardConfig)
    return cfg


@contextmanager
def open_client(token: str | None = None) -> Iterator[VigilClient]:
    """A fresh client for the controller of the current app, closed on exit.

    Its token: ``token`` when given (the sign-in page checking a pasted one), else the signed-in
    session's, else the app's own. A 401 to the session's token (revoked, expired since sign-in)
    signs the session out, so the next call falls back to the app's token.
    """
    cfg = current_config()
    session = auth.session_token() if token is None else None
    chosen = token if token is not None else (session or cfg.token)
    with VigilClient(cfg.api_base_url, token=chosen, timeout=CLIENT_TIMEOUT_S) as client:
        try:
            yield client
        except ApiError as exc:
            if session is not None:
                auth.forget_if_rejected(exc.status_code)
            raise


def describe_error(exc: Exception) -> str:
    """A one-line, user-facing explanation of a failed controller call."""
    if isinstance(exc, ApiError):
        return f"controller answered {exc.status_code}: {exc.detail}"
    if isinstance(exc, httpx.TimeoutException):
        return "controller did not answer in time"
    if isinstance(exc, httpx.HTTPError):
        return f"controller unreachable: {exc}"
    return f"{type(exc).__name__}: {exc}"


FETCH_ERRORS: tuple[type[Exception], ...] = (ApiError, httpx.HTTPError, ValueError)
"""What a controller call may raise: an error status, a transport failure, or a body that does not
match the schema (pydantic's ValidationError is a ValueError). Callbacks show these, never crash."""
