"""Authentication and roles: every route of the app against every kind of caller, token life cycle,
the job-scoped driver token, the metrics gate, and the dashboard's token staying server side.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases (the rest runs on SQLite in tmp_path).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text, update

from controller.auth import (
    METRICS,
    NODE_ACTIONS,
    PUBLIC,
    ROUTE_POLICY,
    bootstrap_tokens,
    check_metrics_access,
    ensure_admin_token,
    guard_metrics_app,
    iter_app_routes,
)
from controller.db import session_scope
from controller.models import ApiToken, Job
from tests.auth import bearer, issue_token
from tests.controller.fakes import FakeLauncher
from tests.harness import build_app, settings_for
from vigil.contract.schemas import Role
from vigil.contract.settings import admin_token_path

API = "/api/v1"
CALLERS = ("none", "revoked", "expired", "admin", "user", "agent", "viewer", "job")


def _app(db_url: str, home: Path, launcher: FakeLauncher | None = None, **settings: Any) -> FastAPI:
    return build_app(settings_for(home, db_url, **settings), launcher=launcher or FakeLauncher(), dashboard=True)


def _expire(app: FastAPI, token: str) -> None:
    """Move a token's expiry into the past (the API refuses to issue one already expired)."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    with session_scope(app.state.sessions) as s:
        s.execute(update(ApiToken).where(ApiToken.token_hash == digest)
                  .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))


def _revoke(app: FastAPI, token: str) -> None:
    digest = hashlib.sha256(token.encode()).hexdigest()
    with session_scope(app.state.sessions) as s:
        s.execute(update(ApiToken).where(ApiToken.token_hash == digest).values(revoked_at=datetime.now(UTC)))


def _batch(job_id: str, seq: int) -> dict:
    now = time.time()
    return {"agent_id": "a1", "node_id": "n1", "seq": seq, "sent_at": now,
            "samples": [{"kind": "step", "job_id": job_id, "rank": 0, "step": 0, "ts": now, "loss": 1.0,
                         "step_time_s": 0.1}],
            "heartbeat": {"ts": now, "hostname": "h"}}


# --------------------------------------------------------------------------------------------------
# The table: every route x every caller
# --------------------------------------------------------------------------------------------------


def test_every_route_has_a_role_decision(tmp_path: Path) -> None:
    """Fails when a route is added (or removed) without its entry in ROUTE_POLICY."""
    app = _app(f"sqlite:///{tmp_path / 'v.db'}", tmp_path)
    routes = {(m, path) for _r, path, methods in iter_app_routes(app) for m in methods}
    assert routes == set(ROUTE_POLICY), (
        f"routes without a decision: {sorted(routes - set(ROUTE_POLICY))}; "
        f"decisions for no route: {sorted(set(ROUTE_POLICY) - routes)}"
    )
    for (method, path), rule in ROUTE_POLICY.items():
        if isinstance(rule, frozenset):
            assert Role.ADMIN in rule, f"admin may do everything, not {method} {path}"
            if Role.JOB in rule:
                assert "{job_id}" in path, f"a job token needs the job in the path: {method} {path}"
            agent_routes = {("POST", "/api/v1/telemetry"), ("POST", "/api/v1/telemetry/columnar"),
                            ("GET", "/api/v1/nodes/{node_id}/commands"),
                            ("POST", "/api/v1/nodes/{node_id}/commands/{command_id}/result"),
                            ("GET", "/api/v1/whoami")}  # who am I: any valid token
            assert Role.AGENT not in rule or (method, path) in agent_routes, (
                f"agents may only ingest and take their node's commands: {method} {path}")
        else:
            assert rule in (PUBLIC, METRICS)


def _expected(rule: frozenset[Role] | str, caller: str, metrics_open: bool, method: str = "", path: str = "") -> str:
    if rule == PUBLIC or (rule == METRICS and metrics_open):
        return "allowed"
    if caller in ("none", "revoked", "expired"):
        return "401"
    if rule == METRICS:
        return "allowed" if Role(caller) in {Role.ADMIN, Role.USER, Role.VIEWER} else "403"
    assert isinstance(rule, frozenset)
    if caller == "user" and (method, path) in NODE_ACTIONS:  # only where the controller allows it
        return "403"
    return "allowed" if Role(caller) in rule else "403"


@pytest.fixture
def table_app(db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str | None], dict[str, str]]]:
    app = _app(db_url, tmp_path, max_body_bytes=64 * 1024)
    with TestClient(app) as client:
        admin = issue_token(app, Role.ADMIN)
        own = client.post(f"{API}/jobs", json={"name": "own"}, headers=bearer(admin)).json()["id"]
        tokens: dict[str, str | None] = {"none": None, "admin": admin}
        for role in ("user", "agent", "viewer"):
            tokens[role] = issue_token(app, role)
        tokens["job"] = issue_token(app, Role.JOB, job_id=own)
        tokens["revoked"] = issue_token(app, Role.ADMIN)
        _revoke(app, tokens["revoked"])  # type: ignore[arg-type]
        tokens["expired"] = issue_token(app, Role.ADMIN, expires_at=datetime.now(UTC) + timedelta(hours=1))
        _expire(app, tokens["expired"])  # type: ignore[arg-type]
        yield client, tokens, {"job_id": own, "admin": admin}


def _request(client: TestClient, method: str, path: str, ids: dict[str, str], token: str | None,
             seq: int) -> Any:
    headers = bearer(token) if token else {}
    if method == "*":  # a mount: what a browser would ask it first
        return client.get(path + "/", headers=headers)
    url = path.replace("{job_id}", ids["job_id"]).replace("{token_id}", ids["token_id"])
    body: dict[str, Any] | None = None
    if (method, path) == ("POST", f"{API}/jobs"):
        body = {"name": "table"}
    elif (method, path) == ("POST", f"{API}/telemetry"):
        body = _batch(ids["job_id"], seq)
    elif (method, path) == ("POST", f"{API}/tokens"):
        body = {"role": "viewer", "name": "table"}
    return client.request(method, url, json=body, headers=headers, follow_redirects=False)


def test_route_table_every_route_every_caller(table_app) -> None:  # type: ignore[no-untyped-def]
    client, tokens, ids = table_app
    app = client.app
    mismatches = []
    seq = 0
    for (method, path), rule in sorted(ROUTE_POLICY.items()):
        for caller in CALLERS:
            # A fresh job and token for each request: cancelling or revoking must not change the next answer.
            ids = {**ids, "token_id": client.post(f"{API}/tokens", json={"role": "viewer"},
                                                   headers=bearer(ids["admin"])).json()["id"]}
            if caller != "job" and "{job_id}" in path:
                # a user's own job (ownership has tests of its own: tests/security/test_ownership.py)
                owner = tokens["user"] if caller == "user" else ids["admin"]
                ids["job_id"] = client.post(f"{API}/jobs", json={"name": "t"}, headers=bearer(owner)).json()["id"]
            if caller == "job":  # the job token's own job (a fresh one would not be its own)
                ids["job_id"] = table_job_id(app, tokens["job"])
            seq += 1
            r = _request(client, method, path, ids, tokens[caller], seq)
            want = _expected(rule, caller, metrics_open=False, method=method, path=path)
            got = "401" if r.status_code == 401 else "403" if r.status_code == 403 else "allowed"
            if got != want or r.status_code >= 500:
                mismatches.append(f"{method} {path} as {caller}: {r.status_code} (want {want}) {r.text[:120]}")
            if r.status_code == 401:
                assert r.headers.get("www-authenticate", "").startswith("Bearer"), (method, path, caller)
    assert mismatches == [], "\n".join(mismatches)


def table_job_id(app: FastAPI, job_token: str | None) -> str:
    digest = hashlib.sha256((job_token or "").encode()).hexdigest()
    with session_scope(app.state.sessions) as s:
        return s.scalar(select(ApiToken.job_id).where(ApiToken.token_hash == digest))  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# What each role may do, spelled out
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    app = _app(db_url, tmp_path)
    with TestClient(app) as c:
        yield c


def _count(client: TestClient, model: type) -> int:
    with client.app.state.sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def test_agent_may_ingest_but_not_submit_cancel_or_read(client: TestClient) -> None:
    app = client.app
    admin, agent = bearer(issue_token(app, "admin")), bearer(issue_token(app, "agent"))
    job_id = client.post(f"{API}/jobs", json={"name": "j"}, headers=admin).json()["id"]
    r = client.post(f"{API}/jobs", json={"name": "by-agent"}, headers=agent)
    assert r.status_code == 403 and "agent" in r.json()["detail"]
    assert client.post(f"{API}/jobs/{job_id}/cancel", headers=agent).status_code == 403
    assert client.get(f"{API}/jobs/{job_id}", headers=agent).status_code == 403
    assert client.get(f"{API}/tokens", headers=agent).status_code == 403
    assert _count(client, Job) == 1
    assert client.get(f"{API}/jobs/{job_id}", headers=admin).json()["status"] == "PENDING"
    assert client.post(f"{API}/telemetry", json=_batch(job_id, 0), headers=agent).json()["stored"] == 1


def test_agent_token_scoped_to_a_node_acts_for_that_node_only(client: TestClient) -> None:
    app = client.app
    admin = bearer(issue_token(app, "admin"))
    scoped = bearer(issue_token(app, "agent", node_id="n1"))
    job_id = client.post(f"{API}/jobs", json={"name": "j"}, headers=admin).json()["id"]
    # its own node: ingest, fetch commands
    assert client.post(f"{API}/telemetry", json=_batch(job_id, 0), headers=scoped).json()["stored"] == 1
    assert client.get(f"{API}/nodes/n1/commands", headers=scoped).status_code == 200
    # another node: refused, nothing stored
    other = dict(_batch(job_id, 1), node_id="n2", agent_id="a2")
    r = client.post(f"{API}/telemetry", json=other, headers=scoped)
    assert r.status_code == 403 and "scoped to node n1" in r.json()["detail"]
    r = client.get(f"{API}/nodes/n2/commands", headers=scoped)
    assert r.status_code == 403 and "n2" in r.json()["detail"]
    t0 = time.monotonic()  # nor may it wait on another node's commands (the long poll): refused at once
    assert client.get(f"{API}/nodes/n2/commands", params={"wait_s": 20}, headers=scoped).status_code == 403
    assert time.monotonic() - t0 < 10
    assert client.post(f"{API}/nodes/n2/commands/1/result", json={"ok": True}, headers=scoped).status_code == 403
    assert client.get(f"{API}/jobs/{job_id}/metrics", headers=admin).json()["ranks"][0]["step"] == [0]
    assert [n["id"] for n in client.get(f"{API}/nodes", headers=admin).json()["data"]] == ["n1"]
    # an unscoped agent token (`vigil token create --role agent`) may act for any node
    assert client.get(f"{API}/nodes/n2/commands", headers=bearer(issue_token(app, "agent"))).status_code == 200
    listed = client.get(f"{API}/tokens", headers=admin).json()["data"]
    assert sorted(t["node_id"] or "" for t in listed if t["role"] == "agent") == ["", "n1"]


def test_viewer_reads_but_does_not_write(client: TestClient) -> None:
    app = client.app
    admin, viewer = bearer(issue_token(app, "admin")), bearer(issue_token(app, "viewer"))
    job_id = client.post(f"{API}/jobs", json={"name": "j"}, headers=admin).json()["id"]
    for path in ("/jobs", f"/jobs/{job_id}", f"/jobs/{job_id}/metrics", f"/jobs/{job_id}/logs", "/nodes", "/events"):
        assert client.get(API + path, headers=viewer).status_code == 200, path
    assert client.post(f"{API}/jobs", json={"name": "v"}, headers=viewer).status_code == 403
    assert client.post(f"{API}/jobs/{job_id}/cancel", headers=viewer).status_code == 403
    assert client.post(f"{API}/telemetry", json=_batch(job_id, 0), headers=viewer).status_code == 403
    assert client.post(f"{API}/tokens", json={"role": "admin"}, headers=viewer).status_code == 403
    assert _count(client, Job) == 1 and _count(client, ApiToken) == 2


def test_user_submits_and_cancels_but_manages_no_tokens(client: TestClient) -> None:
    user = bearer(issue_token(client.app, "user"))
    job_id = client.post(f"{API}/jobs", json={"name": "u"}, headers=user).json()["id"]
    assert client.post(f"{API}/jobs/{job_id}/cancel", headers=user).json()["status"] == "CANCELLED"
    assert client.post(f"{API}/tokens", json={"role": "admin"}, headers=user).status_code == 403
    assert client.get(f"{API}/tokens", headers=user).status_code == 403


def test_job_token_only_touches_its_own_job(client: TestClient) -> None:
    app = client.app
    admin = bearer(issue_token(app, "admin"))
    mine = client.post(f"{API}/jobs", json={"name": "mine"}, headers=admin).json()["id"]
    other = client.post(f"{API}/jobs", json={"name": "other"}, headers=admin).json()["id"]
    job = bearer(issue_token(app, Role.JOB, job_id=mine))
    assert client.get(f"{API}/jobs/{mine}", headers=job).json()["name"] == "mine"
    r = client.get(f"{API}/jobs/{other}", headers=job)
    assert r.status_code == 403 and "own job" in r.json()["detail"]
    assert client.get(f"{API}/jobs/job_does_not_exist", headers=job).status_code == 403  # no existence oracle
    for method, path in (("GET", "/jobs"), ("POST", f"/jobs/{mine}/cancel"), ("GET", "/nodes"),
                         ("GET", "/events"), ("GET", "/tokens"), ("GET", f"/jobs/{mine}/logs")):
        assert client.request(method, API + path, headers=job).status_code == 403, path
    assert client.post(f"{API}/telemetry", json=_batch(mine, 0), headers=job).status_code == 403


@pytest.mark.parametrize(
    "header",
    ["", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Bearer not-a-vigil-token", "Bearer vgl_" + "x" * 43,
     "Bearer vgl_" + "x" * 5000],
)
def test_missing_or_bad_credentials_are_401(client: TestClient, header: str) -> None:
    r = client.get(f"{API}/jobs", headers={"Authorization": header} if header else {})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert client.get(f"{API}/healthz").status_code == 200  # stays open


def test_token_life_cycle_and_only_hashes_stored(client: TestClient) -> None:
    app = client.app
    admin = bearer(issue_token(app, "admin"))
    created = client.post(f"{API}/tokens", json={"role": "user", "name": "ci", "expires_at": (
        datetime.now(UTC) + timedelta(days=7)).isoformat()}, headers=admin)
    assert created.status_code == 201
    body = created.json()
    secret, tid = body["token"], body["id"]
    assert re.fullmatch(r"vgl_[A-Za-z0-9_-]{43}", secret) and body["role"] == "user" and body["active"]
    assert body["last_used_at"] is None
    # Only the hash is stored: the secret appears in no column of any row.
    with app.state.engine.connect() as conn:
        dump = repr(conn.execute(text("SELECT * FROM api_tokens")).all())
    assert secret not in dump and secret[len("vgl_"):] not in dump
    assert hashlib.sha256(secret.encode()).hexdigest() in dump
    # Listing never shows a secret.
    listed = client.get(f"{API}/tokens", headers=admin)
    assert secret not in listed.text and all("token" not in t for t in listed.json()["data"])
    # Usable, and its use is recorded.
    assert client.get(f"{API}/jobs", headers=bearer(secret)).status_code == 200
    row = next(t for t in client.get(f"{API}/tokens", headers=admin).json()["data"] if t["id"] == tid)
    assert row["last_used_at"] is not None
    # Revoked: refused at once; revoking again changes nothing; unknown ids are 404.
    first = client.post(f"{API}/tokens/{tid}/revoke", headers=admin).json()
    assert first["revoked_at"] and not first["active"]
    assert client.get(f"{API}/jobs", headers=bearer(secret)).status_code == 401
    assert client.post(f"{API}/tokens/{tid}/revoke", headers=admin).json()["revoked_at"] == first["revoked_at"]
    assert client.post(f"{API}/tokens/tok_nope/revoke", headers=admin).status_code == 404
    active = client.get(f"{API}/tokens", params={"include_inactive": False}, headers=admin).json()
    assert tid not in {t["id"] for t in active["data"]}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"role": "root"}, "role"),
        ({"role": "job"}, "job_id"),
        ({"role": "user", "job_id": "job_x"}, "job_id"),
        ({"role": "user", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"role": "user", "name": "x" * 200}, "name"),
        ({"role": "user", "name": "a\nb"}, "name"),
        ({"role": "user", "surprise": 1}, "surprise"),
        ({"role": "user", "node_id": "n1"}, "node_id"),
        ({"role": "agent", "node_id": "../n1"}, "node_id"),
    ],
)
def test_bad_token_requests_are_422(client: TestClient, body: dict, field: str) -> None:
    admin = bearer(issue_token(client.app, "admin"))
    r = client.post(f"{API}/tokens", json=body, headers=admin)
    assert r.status_code == 422, r.text
    assert field in r.text
    assert _count(client, ApiToken) == 1


def test_job_token_for_unknown_job_is_404(client: TestClient) -> None:
    admin = bearer(issue_token(client.app, "admin"))
    assert client.post(f"{API}/tokens", json={"role": "job", "job_id": "job_nope"}, headers=admin).status_code == 404


def test_auth_can_be_turned_off(db_url: str, tmp_path: Path) -> None:
    app = _app(db_url, tmp_path, auth_enabled=False)
    with TestClient(app) as c:
        assert c.post(f"{API}/jobs", json={"name": "open"}).status_code == 201
        assert c.get(f"{API}/jobs").json()["count"] == 1


# --------------------------------------------------------------------------------------------------
# The driver's token, issued by the supervisor
# --------------------------------------------------------------------------------------------------


def test_supervisor_gives_the_driver_a_job_token_revoked_when_the_job_ends(client: TestClient) -> None:
    app = client.app
    launcher: FakeLauncher = app.state.launcher
    admin = bearer(issue_token(app, "admin"))
    job_id = client.post(f"{API}/jobs", json={"name": "d"}, headers=admin).json()["id"]
    app.state.supervisor.step()
    driver = bearer(launcher.submitted[0][2]["VIGIL_TOKEN"])
    assert client.get(f"{API}/jobs/{job_id}", headers=driver).status_code == 200
    assert client.get(f"{API}/jobs", headers=driver).status_code == 403
    tok = next(t for t in client.get(f"{API}/tokens", headers=admin).json()["data"] if t["role"] == "job")
    assert tok["job_id"] == job_id and tok["active"]
    client.post(f"{API}/jobs/{job_id}/cancel", headers=admin)
    assert client.get(f"{API}/jobs/{job_id}", headers=driver).status_code == 401


def test_job_token_revoked_when_launch_fails(client: TestClient) -> None:
    app = client.app
    app.state.launcher.fail_submit = True
    app.state.supervisor.launch_retry_s = 0
    admin = bearer(issue_token(app, "admin"))
    client.post(f"{API}/jobs", json={"name": "f"}, headers=admin)
    app.state.supervisor.step()
    job_tokens = [t for t in client.get(f"{API}/tokens", headers=admin).json()["data"] if t["role"] == "job"]
    assert len(job_tokens) == 1 and not job_tokens[0]["active"]


# --------------------------------------------------------------------------------------------------
# /metrics gate (for the Prometheus endpoint, mounted or routed), dashboard, CORS
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metrics_open", [False, True])
def test_metrics_gate_as_route_and_as_mount(tmp_path: Path, metrics_open: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The three ways a /metrics can be served: a route marked METRICS in the policy, a route with
    the check as its dependency, an ASGI app mounted through guard_metrics_app."""
    from prometheus_client import make_asgi_app

    app = _app(f"sqlite:///{tmp_path / 'v.db'}", tmp_path, metrics_open=metrics_open)
    monkeypatch.setitem(ROUTE_POLICY, ("GET", "/probe-policy"), METRICS)
    monkeypatch.setitem(ROUTE_POLICY, ("GET", "/probe-dependency"), PUBLIC)
    app.add_api_route("/probe-policy", lambda: {"ok": True})
    app.add_api_route("/probe-dependency", lambda: {"ok": True}, dependencies=[Depends(check_metrics_access)])
    app.mount("/probe-mounted", guard_metrics_app(make_asgi_app()))
    with TestClient(app) as c:
        viewer, agent = bearer(issue_token(app, "viewer")), bearer(issue_token(app, "agent"))
        for path in ("/probe-policy", "/probe-dependency", "/probe-mounted/"):
            anonymous = c.get(path)
            if metrics_open:
                assert anonymous.status_code == 200, path
            else:
                assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
                assert c.get(path, headers=agent).status_code == 403
            assert c.get(path, headers=viewer).status_code == 200


def test_dashboard_token_stays_server_side_and_no_cors(client: TestClient) -> None:
    app = client.app
    (principal,) = app.state.internal_tokens.values()
    assert principal.role == Role.VIEWER
    mount = next(r for r, path, _m in iter_app_routes(app) if path == "/dashboard")
    from dashboard.context import CONFIG_KEY

    secret = mount.app.app.config[CONFIG_KEY].token
    assert secret and hashlib.sha256(secret.encode()).hexdigest() in app.state.internal_tokens
    evil = {"Origin": "http://evil.example"}
    pages = [client.get("/dashboard/", headers=evil), client.get("/dashboard/_dash-layout", headers=evil),
             client.get("/dashboard/_dash-config", headers=evil)]
    for r in pages:
        assert secret not in r.text
    assert pages[0].status_code == 200
    # The viewer token works for reading, and for nothing else.
    assert client.get(f"{API}/jobs", headers=bearer(secret)).status_code == 200
    assert client.post(f"{API}/jobs", json={"name": "x"}, headers=bearer(secret)).status_code == 403
    # No CORS: no other origin may read answers, and preflights are not granted.
    for r in [*pages, client.get(f"{API}/jobs", headers={**evil, **bearer(secret)}),
              client.options(f"{API}/jobs", headers={**evil, "Access-Control-Request-Method": "POST"})]:
        assert not any(h.lower().startswith("access-control-") for h in r.headers), dict(r.headers)


# --------------------------------------------------------------------------------------------------
# Bootstrap: the admin token file
# --------------------------------------------------------------------------------------------------


def test_bootstrap_writes_a_private_admin_token_and_reuses_it(db_url: str, tmp_path: Path) -> None:
    app = _app(db_url, tmp_path / "home")
    home = tmp_path / "home"
    first = bootstrap_tokens(app.state.sessions, home, ["n1", "n2"])
    path = admin_token_path(home)
    assert first.admin_created and path.read_text().strip() == first.admin
    assert path.stat().st_mode & 0o777 == 0o600
    second = bootstrap_tokens(app.state.sessions, home, ["n1", "n2"])
    assert not second.admin_created and second.admin == first.admin  # still valid: kept
    assert set(first.agents) == {"n1", "n2"} and second.agents["n1"] != first.agents["n1"]
    assert len(set(first.agents.values())) == 2  # one token per node
    with TestClient(app) as c:
        assert c.get(f"{API}/tokens", headers=bearer(first.admin)).status_code == 200
        agent = bearer(first.agents["n1"])
        assert c.post(f"{API}/telemetry", json=_batch("job_x", 0), headers=agent).status_code == 200
        assert c.get(f"{API}/nodes/n2/commands", headers=agent).status_code == 403
        assert c.get(f"{API}/jobs", headers=agent).status_code == 403
        _revoke(app, first.admin)
        token, created = ensure_admin_token(app.state.sessions, home)  # revoked: replaced
        assert created and token != first.admin and path.read_text().strip() == token
        assert c.get(f"{API}/tokens", headers=bearer(token)).status_code == 200
