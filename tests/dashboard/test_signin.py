"""Sign-in (``/signin``): a pasted token is checked against the controller and kept server side.

Unit tests of :mod:`dashboard.auth` (the session store, the header badge, who may act); then the
sign-in callbacks driven over real HTTP as the browser drives them (Dash's ``_dash-update-component``),
checking that no answer, page or cookie ever holds the token; then the page in a real Chromium.
All against the REAL controller (``dashboard_site``: ``create_app()`` on SQLite served live, its
``GET /api/v1/whoami`` deciding who a token is).

Needs: dash, flask, httpx, itsdangerous; for the browser test ``apt-get install -y chromium
chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import httpx
import pytest

from dashboard import auth
from dashboard.app import create_dash_app
from tests.auth import issue_token
from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser
from tests.dashboard.signin_helpers import PREFIX, browser_sign_in, by_input, run_callback, sign_in
from vigil.contract.schemas import Role, TokenCreate, WhoAmI

# --------------------------------------------------------------------------------------------------
# Driving Dash callbacks over HTTP, as the renderer does
# --------------------------------------------------------------------------------------------------


def badge(client: httpx.Client) -> str:
    """The navigation bar's badge after a navigation (the app's own callback)."""
    _, resp = run_callback(client, lambda d: any(i["id"] == "_pages_location" for i in d["inputs"])
                           and "app-auth-badge" in d["output"],
                           {"_pages_location.pathname": PREFIX})
    return resp["app-auth-badge"]["children"]


def flask_session(cookie: str) -> dict[str, Any]:
    """The payload of Flask's signed session cookie (readable by anyone: it is signed, not encrypted)."""
    data = cookie.split(".")[0 if not cookie.startswith(".") else 1]
    raw = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
    if cookie.startswith("."):
        raw = zlib.decompress(raw)
    return json.loads(raw)


# --------------------------------------------------------------------------------------------------
# Unit: the store, the badge, who may act
# --------------------------------------------------------------------------------------------------


def test_session_store_expires_idle_sessions_and_bounds_its_size() -> None:
    now = [0.0]
    store = auth.SessionStore(idle_s=60, max_sessions=2, clock=lambda: now[0])
    alice, bob = auth.Identity(Role.USER, "alice"), auth.Identity(Role.VIEWER, "bob")
    a = store.create("vgl_a", alice)
    b = store.create("vgl_b", bob)
    assert a != b and len(a) >= 40  # 256 random bits, url-safe
    assert (store.token(a), store.identity(a), store.identity(b)) == ("vgl_a", alice, bob)
    assert store.token("forged") is None and store.token(None) is None
    now[0] = 50.0
    assert store.token(a) == "vgl_a"  # a use keeps it alive...
    now[0] = 100.0
    assert store.token(b) is None  # ...an idle one goes
    assert store.token(a) == "vgl_a"
    c = store.create("vgl_c", alice)
    store.create("vgl_d", alice)  # a third live session: the least recently used (a) goes
    assert store.token(a) is None and store.token(c) == "vgl_c" and len(store) == 2
    store.drop(c)
    assert store.token(c) is None and len(store) == 1
    with pytest.raises(ValueError):
        auth.SessionStore(idle_s=0)


def test_header_badge_and_who_may_act() -> None:
    user, viewer, admin = (auth.Identity(r) for r in (Role.USER, Role.VIEWER, Role.ADMIN))
    text, _, signin_style, signout_style = auth.header_state(None)
    assert (text, signin_style["display"], signout_style["display"]) == ("read-only", "inline-block", "none")
    assert auth.header_state(user)[0] == "signed in as user"
    assert auth.header_state(viewer)[2:] == ({"display": "none"}, {"display": "inline-block"})
    assert [auth.may_act(i) for i in (None, viewer, user, admin)] == [False, False, True, True]
    assert "read-only" in auth.refusal("cancel a job", None)
    assert "a viewer token may not cancel a job" in auth.refusal("cancel a job", viewer)


def test_secret_from_the_environment_else_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    a = create_dash_app("http://127.0.0.1:1", requests_pathname_prefix="/")
    b = create_dash_app("http://127.0.0.1:1", requests_pathname_prefix="/")
    assert a.server.secret_key and a.server.secret_key != b.server.secret_key
    monkeypatch.setenv(auth.SECRET_ENV, "s3cret-for-several-processes")
    c = create_dash_app("http://127.0.0.1:1", requests_pathname_prefix="/vigil/")
    assert c.server.secret_key == "s3cret-for-several-processes"
    cfg = c.server.config
    assert (cfg["SESSION_COOKIE_HTTPONLY"], cfg["SESSION_COOKIE_SAMESITE"], cfg["SESSION_COOKIE_PATH"]) == (
        True, "Lax", "/vigil/")


# --------------------------------------------------------------------------------------------------
# Over HTTP, against the real controller
# --------------------------------------------------------------------------------------------------


def test_sign_in_keeps_the_token_on_the_server(dashboard_site: Site) -> None:
    token = issue_token(dashboard_site.controller.app, Role.USER, name="alice")
    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        assert badge(client) == "read-only"
        r, resp = sign_in(client, token)
        assert token not in r.text
        assert resp["signin-token"]["value"] == ""  # the pasted token is cleared from the page
        assert "Signed in as user" in json.dumps(resp["signin-message"])
        assert resp["app-auth-badge"]["children"] == "signed in as user"
        assert "alice" in json.dumps(resp["signin-status"])

        # The cookie: HttpOnly, SameSite=Lax, scoped to the dashboard, holding a session id only.
        set_cookie = r.headers["set-cookie"]
        assert token not in set_cookie
        assert auth.COOKIE_NAME in set_cookie and "HttpOnly" in set_cookie and "SameSite=Lax" in set_cookie
        assert "Path=/dashboard/" in set_cookie
        payload = flask_session(client.cookies[auth.COOKIE_NAME])
        assert list(payload) == [auth.SID_KEY] and token not in json.dumps(payload)

        # Nothing the browser loads afterwards holds it either; the session is used for reading.
        assert badge(client) == "signed in as user"
        for path in ("", "signin", "_dash-layout", "_dash-dependencies"):
            page = client.get(PREFIX + path)
            assert page.status_code == 200 and token not in page.text, path
        assert "signed in as user" in client.get(PREFIX + "_dash-layout").text
        r, resp = run_callback(client, by_input("jobs-interval"), {"jobs-interval.n_intervals": 1})
        assert token not in r.text and "pydoc-dsm" in r.text

        # Sign out: the server forgets the token; the same cookie is read-only again.
        cookie = client.cookies[auth.COOKIE_NAME]
        r, resp = run_callback(client, by_input("app-signout"), {"app-signout.n_clicks": 1})
        assert resp["app-auth-badge"]["children"] == "read-only"
        assert token not in r.text
    with httpx.Client(base_url=dashboard_site.url, timeout=30, cookies={auth.COOKIE_NAME: cookie}) as replay:
        assert badge(replay) == "read-only"


def test_tokens_the_dashboard_does_not_accept(dashboard_site: Site) -> None:
    app = dashboard_site.controller.app
    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        cases = {
            "vgl_not-a-real-token": "does not know this token",
            issue_token(app, Role.AGENT, node_id="node-1"): "an agent token cannot use the dashboard",
            issue_token(app, Role.JOB, job_id=dashboard_site.demo.abc): "this token may not use the dashboard",
            "": "Paste a token first",
            "two words": "not a Vigil token",
        }
        for token, why in cases.items():
            r, resp = sign_in(client, token)
            assert why in json.dumps(resp["signin-message"]), (token, resp)
            assert resp["app-auth-badge"]["children"] == "read-only"
            assert not token or token not in r.text
            assert auth.COOKIE_NAME not in r.headers.get("set-cookie", "")

        # A viewer may sign in (and read); the badge says so.
        _, resp = sign_in(client, issue_token(app, Role.VIEWER))
        assert resp["app-auth-badge"]["children"] == "signed in as viewer"
        assert "may only read" in json.dumps(resp["signin-status"])


def test_a_token_revoked_after_sign_in_ends_the_session(dashboard_site: Site) -> None:
    with dashboard_site.controller.client(Role.ADMIN) as admin:
        created = admin.create_token(TokenCreate(role=Role.USER, name="soon revoked"))
        with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
            sign_in(client, created.token)
            assert badge(client) == "signed in as user"
            admin.revoke_token(created.id)
            assert badge(client) == "read-only"  # the next navigation finds the controller refusing it


def test_whoami_schema_never_carries_a_secret() -> None:
    assert set(WhoAmI.model_fields) == {"token_id", "role", "name", "job_id", "node_id"}


# --------------------------------------------------------------------------------------------------
# In a real browser
# --------------------------------------------------------------------------------------------------


def test_sign_in_and_out_in_the_browser(page: Browser, dashboard_site: Site) -> None:
    token = issue_token(dashboard_site.controller.app, Role.USER, name="carol")
    page.get(dashboard_site.dashboard)
    page.wait_equal(lambda: page.text("app-auth-badge"), "read-only", what="read-only badge")
    page.css("#app-nav-signin")[0].click()
    page.wait_css("#signin-token")
    browser_sign_in(page, dashboard_site, token)
    assert page.css("#signin-token")[0].get_attribute("value") == ""
    assert token not in page.driver.page_source
    assert page.js("return document.cookie;") == ""  # HttpOnly: no script can read the session cookie
    assert "signed in as user" in (page.text("signin-status") or "")

    # It lasts across pages and reloads (the cookie), and sign-out ends it.
    page.get(f"{dashboard_site.dashboard}nodes")
    page.wait_equal(lambda: page.text("app-auth-badge"), "signed in as user", what="badge on another page")
    assert not page.css("#app-nav-signin")[0].is_displayed()
    page.css("#app-signout")[0].click()
    page.wait_equal(lambda: page.text("app-auth-badge"), "read-only", what="badge after sign-out")
    page.get(f"{dashboard_site.dashboard}nodes")
    page.wait_equal(lambda: page.text("app-auth-badge"), "read-only", what="read-only after reload")
    assert page.css("#app-nav-signin")[0].is_displayed()
    assert page.console_errors() == []
