"""Actions from the dashboard (:mod:`dashboard.actions`): cancel / recover / inject a fault into a job,
evict / readmit a node; each confirmed in a dialog, and only for a signed-in user or admin.

Unit tests of the pure parts (the fault form, error messages); then the panels' callbacks over real
HTTP and in a real Chromium against the REAL controller (``tests.live_controller``: ``create_app()``
on SQLite served live; only Ray is faked, so an eviction only marks the node EVICTED). The job panel
is in the job page's header, the node panel on the node page.

Needs: dash, dash-bootstrap-components, httpx; for the browser tests ``apt-get install -y chromium
chromium-driver`` (skipped without), selenium, uvicorn, a2wsgi.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboard import actions
from tests.auth import issue_token
from tests.dashboard.conftest import Site, seed_demo
from tests.dashboard.harness import Browser
from tests.dashboard.signin_helpers import browser_sign_in, by_input, run_callback, sign_in
from tests.live_controller import LiveController
from vigil.contract.client import ApiError
from vigil.contract.schemas import FaultKind, JobStatus, NodeState, Role

# --------------------------------------------------------------------------------------------------
# Unit
# --------------------------------------------------------------------------------------------------


def test_fault_form_parsing() -> None:
    f = actions.parse_fault("slow_rank", 2, "", 40, '{"factor": 4, "mode": "compute"}')
    assert (f.kind, f.rank, f.node_id, f.step) == (FaultKind.SLOW_RANK, 2, None, 40)
    assert f.params == {"factor": 4, "mode": "compute"}
    f = actions.parse_fault("kill_node", None, " node-3 ", None, "")
    assert (f.kind, f.rank, f.node_id, f.step, f.params) == (FaultKind.KILL_NODE, None, "node-3", 0, {})
    with pytest.raises(ValueError, match="rank: required for hang_rank"):
        actions.parse_fault("hang_rank", None, None, 0, "{}")
    with pytest.raises(ValueError, match="params: not JSON"):
        actions.parse_fault("slow_rank", 0, None, 0, "{factor: 3")
    with pytest.raises(TypeError, match="JSON object"):
        actions.parse_fault("slow_rank", 0, None, 0, "[3]")
    with pytest.raises(ValueError, match="factor"):
        actions.parse_fault("slow_rank", 0, None, 0, '{"factor": 1000}')


def test_messages_for_a_refusing_controller() -> None:
    assert actions.describe_action_error(ApiError(403, "role viewer may not POST /api/v1/jobs/{job_id}/cancel")) == (
        "Refused by the controller: role viewer may not POST /api/v1/jobs/{job_id}/cancel")
    assert actions.describe_action_error(ApiError(409, "job 'j' already ended as CANCELLED")) == (
        "Failed: controller answered 409: job 'j' already ended as CANCELLED")
    assert "sign in again" in actions.describe_action_error(ApiError(401, "the token is unknown"))


def test_panels_have_the_documented_ids() -> None:
    def ids(component: Any) -> set[str]:
        out = {component.id} if getattr(component, "id", None) else set()
        children = getattr(component, "children", None)
        for child in children if isinstance(children, list) else [children]:
            if child is not None and not isinstance(child, str):
                out |= ids(child)
        return out

    job = ids(actions.job_actions_panel("job-1"))
    assert {"actions-job-cancel", "actions-job-recover", "actions-job-fault", "actions-job-confirm",
            "actions-job-dismiss", "actions-job-modal", "actions-job-result"} <= job
    assert all(i.startswith("actions-job-") for i in job)
    node = ids(actions.node_actions_panel("node-1"))
    assert {"actions-node-evict", "actions-node-readmit", "actions-node-confirm", "actions-node-result"} <= node
    assert all(i.startswith("actions-node-") for i in node)


# --------------------------------------------------------------------------------------------------
# A site whose pages all carry the demo job's action panel
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def actions_site(tmp_path: Path) -> Iterator[Site]:
    """The real controller, seeded like ``dashboard_site``, with the dashboard mounted at /dashboard as
    the controller mounts it (viewer token, polling every 500 ms): the job page carries the job's
    action panel in its header, the node page the node's."""
    from a2wsgi import WSGIMiddleware

    from dashboard.app import create_dash_app

    def mount(app: Any, url: str) -> None:
        dash_app = create_dash_app(url, token=issue_token(app, Role.VIEWER, name="dashboard"), refresh_ms=500)
        app.mount("/dashboard", WSGIMiddleware(dash_app.server))

    ctl = LiveController(tmp_path / "controller", extend=mount).start()
    try:
        yield Site(url=ctl.url, controller=ctl, demo=seed_demo(ctl))
    finally:
        ctl.stop()


def _job_status(site: Site, job_id: str) -> JobStatus:
    site.controller.settle()
    with site.controller.client(Role.ADMIN) as c:
        return c.get_job(job_id).status


def _node_state(site: Site, node_id: str) -> NodeState:
    site.controller.settle()
    with site.controller.client(Role.ADMIN) as c:
        return next(n.state for n in c.list_nodes().data if n.id == node_id)


def _ask(client: httpx.Client, button: str, job_id: str) -> dict[str, Any]:
    _, resp = run_callback(client, by_input(f"actions-job-{button}"),
                           {f"actions-job-{button}.n_clicks": 1, "actions-job-id.data": job_id})
    return resp


def _confirm(client: httpx.Client, job_id: str, action: str, **form: Any) -> str:
    fields = {f"actions-job-{k.replace('_', '-')}.value": v for k, v in form.items()}
    values = {"actions-job-confirm.n_clicks": 1, "actions-job-pending.data": {"action": action},
              "actions-job-id.data": job_id, **fields}
    _, resp = run_callback(client, by_input("actions-job-confirm"), values)
    assert resp["actions-job-modal"]["is_open"] is False
    return json.dumps(resp["actions-job-result"])


# --------------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------------


def test_read_only_and_viewer_are_refused_and_nothing_is_sent(actions_site: Site) -> None:
    abc = actions_site.demo.abc
    faults_before = len(actions_site.controller.events(job_id=abc, kind="fault_created"))
    with httpx.Client(base_url=actions_site.url, timeout=30) as client:
        for who in ("read-only", "viewer"):
            if who == "viewer":
                sign_in(client, issue_token(actions_site.controller.app, Role.VIEWER))
            for button in ("cancel", "recover", "fault"):
                resp = _ask(client, button, abc)
                assert resp["actions-job-modal"]["is_open"] is False  # no dialog: refused at once
                text = json.dumps(resp["actions-job-result"])
                assert "Refused" in text and ("read-only" in text if who == "read-only" else "a viewer token" in text)
            # Even a forged confirmation (as if the dialog had been opened) is refused by the dashboard.
            for action in ("cancel", "recover", "fault"):
                assert "Refused" in _confirm(client, abc, action, fault_kind="kill_rank", fault_rank=0)
        node = run_callback(client, by_input("actions-node-confirm"), {
            "actions-node-confirm.n_clicks": 1, "actions-node-pending.data": {"action": "evict"},
            "actions-node-id.data": "node-1"})[1]
        assert "Refused" in json.dumps(node["actions-node-result"])
    assert _job_status(actions_site, abc) == JobStatus.RUNNING
    assert _node_state(actions_site, "node-1") == NodeState.ALIVE
    assert len(actions_site.controller.events(job_id=abc, kind="fault_created")) == faults_before


def _users_job(site: Site, token: str) -> str:
    """A running job submitted with the user's own token (a user acts only on the jobs it submitted)."""
    r = httpx.post(f"{site.url}/api/v1/jobs", json={"name": "mine", "steps": 100}, timeout=30,
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    site.controller.set_job_status(r.json()["id"], JobStatus.RUNNING)
    return r.json()["id"]


def test_a_user_injects_a_fault_recovers_and_cancels(actions_site: Site) -> None:
    ctl, others = actions_site.controller, actions_site.demo.abc
    token = issue_token(ctl.app, Role.USER)
    abc = _users_job(actions_site, token)
    with httpx.Client(base_url=actions_site.url, timeout=30) as client:
        sign_in(client, token)
        # Another's job (the admin's demo): the controller refuses and the dashboard says so.
        theirs = _confirm(client, others, "cancel")
        assert "Refused by the controller" in theirs and "submitted by another token" in theirs, theirs
        assert _job_status(actions_site, others) == JobStatus.RUNNING
        opened = _ask(client, "fault", abc)
        assert opened["actions-job-modal"]["is_open"] is True
        assert opened["actions-job-fault-form"]["style"] == {"display": "block"}
        assert opened["actions-job-pending"]["data"] == {"action": "fault"}

        bad = _confirm(client, abc, "fault", fault_kind="hang_rank", fault_rank=None, fault_step=0, fault_params="{}")
        assert "Not sent" in bad and "rank: required for hang_rank" in bad
        text = _confirm(client, abc, "fault", fault_kind="slow_rank", fault_rank=1, fault_node="", fault_step=5000,
                        fault_params='{"factor": 2}')
        assert "(slow_rank on rank 1 at step 5000) is PENDING" in text, text
        with ctl.client(Role.ADMIN) as admin:
            (fault,) = [f for f in admin.list_faults(abc).data if f.rank == 1]
        assert (fault.kind, fault.step, fault.params) == (FaultKind.SLOW_RANK, 5000, {"factor": 2})

        text = _confirm(client, abc, "recover", recover_reason="loss looks off", recover_evict="")
        assert "Recovery started: incident" in text, text
        with ctl.client(Role.ADMIN) as admin:
            assert any(i.kind.value == "manual" for i in admin.job_incidents(abc).data)

        assert "Cancelled: job" in _confirm(client, abc, "cancel")
        assert _job_status(actions_site, abc) == JobStatus.CANCELLED
        # The controller's own refusal is shown: the job has ended.
        again = _confirm(client, abc, "cancel")
        assert "Failed: controller answered 409" in again and "already ended" in again


# --------------------------------------------------------------------------------------------------
# In a real browser
# --------------------------------------------------------------------------------------------------


def _modal_open(page: Browser, prefix: str) -> bool:
    shown = page.css(f".modal.show #{prefix}-modal")  # dbc puts the id on the dialog inside .modal
    return bool(shown) and page.css(f"#{prefix}-confirm")[0].is_displayed()


def _wait_drawn(page: Browser) -> None:
    """Until the job page's first refresh has drawn its header: a person clicks on a page they see."""
    page.wait_for(lambda: "restarts:" in (page.text("job-detail-summary") or ""), what="job header drawn")


def test_browser_read_only_refusal_then_sign_in_and_cancel(browser: Browser, actions_site: Site) -> None:
    abc, page = actions_site.demo.abc, browser
    page.blank()
    try:
        page.get(f"{actions_site.dashboard}jobs/{abc}")
        page.wait_for(lambda: page.css("#job-detail-actions #actions-job-cancel"), what="job actions panel")
        _wait_drawn(page)
        page.wait_equal(lambda: page.text("app-auth-badge"), "read-only", what="read-only badge")
        page.css("#actions-job-cancel")[0].click()
        page.wait_for(lambda: "Refused" in (page.text("actions-job-result") or ""), what="refusal")
        assert "read-only" in page.text("actions-job-result")
        assert not _modal_open(page, "actions-job")
        assert _job_status(actions_site, abc) == JobStatus.RUNNING

        token = issue_token(actions_site.controller.app, Role.USER)
        abc = _users_job(actions_site, token)  # a user cancels the jobs it submitted
        browser_sign_in(page, actions_site, token)
        page.get(f"{actions_site.dashboard}jobs/{abc}")
        page.wait_for(lambda: page.css("#actions-job-cancel"), what="job actions panel")
        _wait_drawn(page)
        # Cancel, and dismiss: nothing happens.
        page.css("#actions-job-cancel")[0].click()
        page.wait_for(lambda: _modal_open(page, "actions-job"), what="confirmation dialog")
        assert f"Cancel job {abc}?" in page.text("actions-job-modal-text")
        page.css("#actions-job-dismiss")[0].click()
        page.wait_for(lambda: not _modal_open(page, "actions-job"), what="dialog closed")
        assert _job_status(actions_site, abc) == JobStatus.RUNNING
        # Cancel, and confirm: the controller cancels the job.
        page.css("#actions-job-cancel")[0].click()
        page.wait_for(lambda: _modal_open(page, "actions-job"), what="confirmation dialog")
        page.css("#actions-job-confirm")[0].click()
        page.wait_for(lambda: "Cancelled" in (page.text("actions-job-result") or ""), what="cancelled")
        assert _job_status(actions_site, abc) == JobStatus.CANCELLED
        assert page.console_errors() == []
    finally:
        page.blank()


def test_browser_evict_and_readmit_from_the_node_page(browser: Browser, actions_site: Site) -> None:
    page = browser
    page.blank()
    try:
        page.get(f"{actions_site.dashboard}nodes/node-1")
        page.wait_for(lambda: page.css("#actions-node-evict"), what="node actions")
        page.css("#actions-node-evict")[0].click()
        page.wait_for(lambda: "Refused" in (page.text("actions-node-result") or ""), what="read-only refusal")
        assert _node_state(actions_site, "node-1") == NodeState.ALIVE

        browser_sign_in(page, actions_site, issue_token(actions_site.controller.app, Role.ADMIN), role="admin")
        page.get(f"{actions_site.dashboard}nodes/node-1")
        page.wait_for(lambda: "ALIVE" in (page.text("node-detail-header") or ""), what="ALIVE header")
        page.css("#actions-node-evict")[0].click()
        page.wait_for(lambda: _modal_open(page, "actions-node"), what="confirmation dialog")
        assert "Evict node node-1?" in page.text("actions-node-modal-text")
        page.css("#actions-node-confirm")[0].click()
        page.wait_for(lambda: "Evicted" in (page.text("actions-node-result") or ""), what="evicted")
        assert _node_state(actions_site, "node-1") == NodeState.EVICTED
        page.wait_for(lambda: "EVICTED" in (page.text("node-detail-header") or ""), what="EVICTED on the page")

        page.css("#actions-node-readmit")[0].click()
        page.wait_for(lambda: _modal_open(page, "actions-node"), what="confirmation dialog")
        page.css("#actions-node-confirm")[0].click()
        page.wait_for(lambda: "Readmitted" in (page.text("actions-node-result") or ""), what="readmitted")
        assert _node_state(actions_site, "node-1") == NodeState.ALIVE
        assert page.console_errors() == []
    finally:
        page.blank()
