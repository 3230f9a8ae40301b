"""Sign-in for the dashboard: a person's Vigil token, kept on the server, never in the browser.

The dashboard reads the controller with its own token (the mounted dashboard's viewer token, or
``--token`` standalone) and is read-only with it. A person who pastes a token on ``/signin`` gets
their own session:

* the token is checked against the controller (``GET /api/v1/whoami``) and kept in a
  :class:`SessionStore` in this process, under a random session id (256 bits);
* the browser holds only that id, in Flask's signed session cookie (``HttpOnly``,
  ``SameSite=Lax``, path = the dashboard's prefix). The token is never in a page, a cookie, a
  ``dcc.Store`` or a callback answer; the sign-in callback clears the input it was pasted into;
* callbacks then call the controller with the session's token (:func:`session_token`, used by
  :func:`dashboard.context.open_client`); sign-out forgets it, and so does a controller that no
  longer accepts it (:func:`forget_if_rejected`).

The cookie is signed with the app's Flask secret: ``VIGIL_DASHBOARD_SECRET`` when set (several
processes, or sessions that survive a restart), else random per process (a restart signs everyone
out, which is also what the in-memory store does).

Actions (cancel, recover, evict, inject a fault) are for a signed-in ``user`` or ``admin`` only
(:func:`may_act`): the app's own token never acts, whatever its role.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import flask

from vigil.contract.schemas import Role, WhoAmI

SECRET_ENV = "VIGIL_DASHBOARD_SECRET"
"""Environment variable holding the Flask secret that signs the session cookie (else random per process)."""
STORE_KEY = "VIGIL_DASHBOARD_SESSIONS"
"""Where the app's :class:`SessionStore` lives in its Flask config."""
COOKIE_NAME = "vigil_dashboard_session"
SID_KEY = "sid"
"""The one thing the cookie holds: the session id."""
SESSION_IDLE_S = 8 * 3600.0
"""A session unused for this long is forgotten."""
MAX_SESSIONS = 1000
"""At most this many sessions are kept; the least recently used goes first."""
DASHBOARD_ROLES = frozenset({Role.ADMIN, Role.USER, Role.VIEWER})
"""Roles that may sign in: those that may read the API (agent and job tokens may not)."""
ACTION_ROLES = frozenset({Role.ADMIN, Role.USER})
"""Roles that may act from the dashboard (the controller's WRITE routes allow the same)."""
HEADER_OUTPUTS = (
    ("app-auth-badge", "children"),
    ("app-auth-badge", "color"),
    ("app-nav-signin", "style"),
    ("app-signout", "style"),
)
"""(component id, property) of the navigation bar's sign-in state, in :func:`header_state`'s order.
The app's callbacks and the sign-in page's set them."""


class SignInError(ValueError):
    """A token the dashboard does not accept (unknown to the controller, or a role that cannot read)."""


@dataclass(frozen=True)
class Identity:
    """Who is signed in, as the controller described the token; never the token itself."""

    role: Role
    name: str = ""
    token_id: str | None = None

    @classmethod
    def from_whoami(cls, me: WhoAmI) -> Identity:
        return cls(role=me.role, name=me.name, token_id=me.token_id)

    @property
    def label(self) -> str:
        """``signed in as user`` (the header badge)."""
        return f"signed in as {self.role.value}"


@dataclass
class _Session:
    token: str
    identity: Identity
    last_used: float


class SessionStore:
    """Signed-in sessions of one dashboard app, in memory: session id -> (token, identity).

    Thread-safe (Dash callbacks run on the server's worker threads). Sessions idle for more than
    ``idle_s`` are forgotten, and at most ``max_sessions`` are kept (least recently used first out),
    so a flood of sign-ins cannot grow the process without bound.
    """

    def __init__(
        self,
        idle_s: float = SESSION_IDLE_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_s <= 0 or max_sessions < 1:
            raise ValueError("idle_s must be > 0 and max_sessions >= 1")
        self._idle_s = idle_s
        self._max = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def create(self, token: str, identity: Identity) -> str:
        """Keep ``token`` under a new random session id, and return the id."""
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[sid] = _Session(token, identity, self._clock())
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        return sid

    def _get(self, sid: str | None) -> _Session | None:
        if not sid:
            return None
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is None:
                return None
            now = self._clock()
            if now - entry.last_used > self._idle_s:
                del self._sessions[sid]
                return None
            entry.last_used = now
            self._sessions.move_to_end(sid)
            return entry

    def identity(self, sid: str | None) -> Identity | None:
        entry = self._get(sid)
        return entry.identity if entry else None

    def token(self, sid: str | None) -> str | None:
        entry = self._get(sid)
        return entry.token if entry else None

    def drop(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                self._sessions.pop(sid, None)


def configure_server(server: flask.Flask, cookie_path: str, secret: str | None = None) -> SessionStore:
    """Give ``server`` its cookie settings, its secret and a fresh :class:`SessionStore` (returned).

    ``secret``: the key that signs the session cookie; default ``$VIGIL_DASHBOARD_SECRET``, else
    32 random bytes (sessions then last as long as the process, like the in-memory store).
    """
    key = secret or os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    server.secret_key = key
    server.config.update(
        SESSION_COOKIE_NAME=COOKIE_NAME,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_PATH=cookie_path,
    )
    store = SessionStore()
    server.config[STORE_KEY] = store
    server.before_request(_same_origin_only)
    return store


def _same_origin_only() -> flask.Response | None:
    """Refuse a state-changing request a browser sent from another site (every Dash callback, the actions
    included, is a POST): its ``Origin`` must be this server's. A request without ``Origin`` comes from no
    browser page (a browser always sends it on a POST) and goes on to the usual checks."""
    if flask.request.method in ("GET", "HEAD", "OPTIONS"):
        return None
    origin = flask.request.headers.get("Origin")
    if origin is None:
        return None
    from urllib.parse import urlsplit

    if origin == "null" or urlsplit(origin).netloc != flask.request.host:
        return flask.Response(f"refused: a request from {origin} to this dashboard ({flask.request.host})", 403)
    return None


def _store() -> SessionStore:
    store = flask.current_app.config[STORE_KEY]
    assert isinstance(store, SessionStore)
    return store


def _sid() -> str | None:
    if not flask.has_request_context():  # Dash builds its validation layout outside any request
        return None
    sid = flask.session.get(SID_KEY)
    return sid if isinstance(sid, str) else None


def current_identity() -> Identity | None:
    """Who is signed in in the current request's session, or None (read-only; also outside a request)."""
    sid = _sid()
    return _store().identity(sid) if sid else None


def session_token() -> str | None:
    """The signed-in session's token (for calls to the controller only; never hand it to the page)."""
    sid = _sid()
    return _store().token(sid) if sid else None


def sign_in(token: str, me: WhoAmI) -> Identity:
    """Start a session for ``token``, which the controller described as ``me`` (call inside a request).

    Raises :class:`SignInError` for a role that cannot read the dashboard (agent, job).
    """
    if me.role not in DASHBOARD_ROLES:
        raise SignInError(f"{_a(me.role.value)} token cannot use the dashboard (admin, user or viewer only)")
    identity = Identity.from_whoami(me)
    store = _store()
    store.drop(_sid())
    flask.session[SID_KEY] = store.create(token, identity)
    return identity


def sign_out() -> None:
    """Forget the current session's token and clear the cookie's session id."""
    _store().drop(_sid())
    flask.session.pop(SID_KEY, None)


def forget_if_rejected(status_code: int) -> bool:
    """After the controller answered ``status_code`` to a call made with the session's token: a 401
    means it no longer accepts the token (revoked, expired), so the session is forgotten. Returns
    whether it was."""
    if status_code == 401 and _sid() is not None:
        sign_out()
        return True
    return False


def may_act(identity: Identity | None) -> bool:
    """Whether ``identity`` may cancel, recover, evict, readmit or inject faults from the dashboard."""
    return identity is not None and identity.role in ACTION_ROLES


def refusal(what: str, identity: Identity | None) -> str:
    """Why ``identity`` may not ``what`` (a sentence for the page)."""
    if identity is None:
        return f"Refused: the dashboard is read-only. Sign in with a user or admin token to {what}."
    return f"Refused: {_a(identity.role.value)} token may not {what}; sign in with a user or admin token."


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def header_state(identity: Identity | None) -> tuple[str, str, dict[str, str], dict[str, str]]:
    """What the navigation bar shows for ``identity``: the badge's text and colour, and the styles of
    the "Sign in" link and the "Sign out" button (one of them hidden)."""
    shown, hidden = {"display": "inline-block"}, {"display": "none"}
    if identity is None:
        return "read-only", "secondary", shown, hidden
    return identity.label, "success" if identity.role in ACTION_ROLES else "info", hidden, shown
