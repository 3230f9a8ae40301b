"""``GET /api/v1/whoami`` and ``VigilClient.whoami``: who a token is (id, role, name, scope), never its
secret; 401 without a valid token, 403 for a job token (not a role the route allows).

Needs: the controller's dependencies; SQLite in tmp_path; the REAL controller served live for the
client (``tests.live_controller``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.auth import bearer, issue_token
from tests.harness import build_app, settings_for
from tests.live_controller import LiveController
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import Role, TokenCreate, WhoAmI

API = "/api/v1"


@pytest.fixture
def app(tmp_path: Path):  # type: ignore[no-untyped-def]
    return build_app(settings_for(tmp_path))


def test_whoami_names_the_token_and_its_scope(app) -> None:  # type: ignore[no-untyped-def]
    with TestClient(app) as client:
        user = issue_token(app, Role.USER, name="alice's laptop")
        r = client.get(f"{API}/whoami", headers=bearer(user))
        assert r.status_code == 200, r.text
        me = WhoAmI.model_validate(r.json())
        assert (me.role, me.name, me.job_id, me.node_id) == (Role.USER, "alice's laptop", None, None)
        assert me.token_id and me.token_id.startswith("tok_")
        assert user not in r.text  # the secret is never echoed

        agent = issue_token(app, Role.AGENT, node_id="node-7")
        me = WhoAmI.model_validate(client.get(f"{API}/whoami", headers=bearer(agent)).json())
        assert (me.role, me.node_id) == (Role.AGENT, "node-7")
        for role in (Role.ADMIN, Role.VIEWER):
            assert client.get(f"{API}/whoami", headers=bearer(issue_token(app, role))).json()["role"] == role.value


def test_whoami_refuses_no_token_a_bad_one_and_a_job_token(app) -> None:  # type: ignore[no-untyped-def]
    with TestClient(app) as client:
        assert client.get(f"{API}/whoami").status_code == 401
        assert client.get(f"{API}/whoami", headers=bearer("vgl_not-a-token")).status_code == 401
        admin = issue_token(app, Role.ADMIN)
        job = client.post(f"{API}/jobs", json={"name": "j", "steps": 10}, headers=bearer(admin)).json()["id"]
        assert client.get(f"{API}/whoami", headers=bearer(issue_token(app, Role.JOB, job_id=job))).status_code == 403


def test_client_whoami_against_the_live_controller(tmp_path: Path) -> None:
    with LiveController(tmp_path) as ctl:
        with ctl.client(Role.ADMIN) as admin:
            created = admin.create_token(TokenCreate(role=Role.VIEWER, name="wall screen"))
        with VigilClient(ctl.url, token=created.token) as viewer:
            me = viewer.whoami()
        assert (me.token_id, me.role, me.name) == (created.id, Role.VIEWER, "wall screen")
        with VigilClient(ctl.url, token="vgl_nope") as nobody, pytest.raises(ApiError) as err:
            nobody.whoami()
        assert err.value.status_code == 401
