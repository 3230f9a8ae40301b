"""Attacks between users: a ``user`` token acting on another user's job, or moving every job's ranks.

Finding (issue 23): any ``user`` token could cancel, recover or inject faults into any other user's job, and
evict any node. Jobs now record the token that submitted them (``created_by``); a user changes only its own
jobs, evicts or readmits nodes only where the controller allows it, and reads stay open to every reading role.
Each test failed on the code before the fix. The controller is the real app and database (SQLite)."""

from __future__ import annotations

from tests.auth import bearer, issue_token
from tests.controller.recovery_env import API, Env
from vigil.contract.schemas import Role


def test_a_user_changes_only_the_jobs_it_submitted(env: Env) -> None:
    app = env.client.app
    alice, bob = bearer(issue_token(app, Role.USER, name="alice")), bearer(issue_token(app, Role.USER, name="bob"))
    job = env.client.post(f"{API}/jobs", json={"name": "alice's"}, headers=alice).json()
    assert job["created_by"] is not None and job["created_by"] != env.client.get(f"{API}/jobs/{env.job_id}").json()[
        "created_by"]
    jid = job["id"]
    attacks = [
        ("POST", f"/jobs/{jid}/cancel", None),
        ("POST", f"/jobs/{jid}/faults", {"kind": "kill_rank", "rank": 0}),
        ("POST", f"/jobs/{jid}/recover", {"reason": "mine now"}),
        ("POST", f"/jobs/{jid}/faults/1/clear", None),
    ]
    for method, path, body in attacks:
        r = env.client.request(method, API + path, json=body, headers=bob)
        assert r.status_code == 403 and "submitted by another token" in r.text, (path, r.status_code, r.text)
    assert env.client.get(f"{API}/jobs/{jid}/faults").json()["data"] == []  # nothing stored
    assert env.client.get(f"{API}/jobs/{jid}", headers=bob).status_code == 200  # reading stays open
    # the owner may, and so may an admin; a user may not touch an admin's job either
    assert env.client.post(f"{API}/jobs/{jid}/faults", json={"kind": "kill_rank", "rank": 0}, headers=alice
                           ).status_code == 201
    assert env.client.post(f"{API}/jobs/{env.job_id}/cancel", headers=alice).status_code == 403
    assert env.client.post(f"{API}/jobs/{jid}/cancel", headers=alice).json()["status"] == "CANCELLED"
    assert env.client.get(f"{API}/jobs/{env.job_id}").json()["status"] == "RUNNING"


def test_a_user_moves_no_ranks_off_a_node_unless_the_controller_allows_it(env: Env) -> None:
    env.steps(1, 2)
    user = bearer(issue_token(env.client.app, Role.USER))
    r = env.client.post(f"{API}/nodes/vigil-node-2/evict", headers=user)
    assert r.status_code == 403 and "VIGIL_USER_NODE_ACTIONS" in r.text, r.text
    assert env.cluster.drained == []
    env.client.app.state.settings.user_node_actions = True
    assert env.client.post(f"{API}/nodes/vigil-node-2/evict", headers=user).status_code == 200
    assert [n for n, _ in env.cluster.drained] == ["vigil-node-2"]
