"""The dashboard app over real HTTP, without a browser.

Checks the mounting the controller uses (FastAPI + a2wsgi ``WSGIMiddleware`` at ``/dashboard``,
``requests_pathname_prefix="/dashboard/"``, ``routes_pathname_prefix="/"``): index, JS bundles,
layout and callbacks all reachable under the prefix and the API still served beside it. Callbacks
are driven through Dash's own ``_dash-update-component`` endpoint, as the browser does.
Also: the standalone entry point, two apps in one process, error display, and that importing
the dashboard pulls in neither torch nor ray.

Needs: fastapi, uvicorn, a2wsgi, httpx; the REAL controller (``dashboard_site``: ``create_app()`` on
SQLite served live, seeded through its REST API, see ``conftest.py``). No browser.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboard.app import _normalise_prefix, create_dash_app
from dashboard.registry import BUSY_POLL_MS
from tests.dashboard.conftest import Site

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# Helpers: drive Dash the way its renderer does
# --------------------------------------------------------------------------------------------------


class _Http:
    """GET/POST over an httpx client or a Flask test client, with one interface."""

    def __init__(self, client: Any, base: str = "") -> None:
        self.client, self.base = client, base

    def get(self, path: str) -> tuple[int, str]:
        r = self.client.get(self.base + path)
        text = r.text if isinstance(getattr(r, "text", None), str) else r.get_data(as_text=True)
        return r.status_code, text

    def get_json(self, path: str) -> Any:
        status, text = self.get(path)
        assert status == 200, (path, status, text[:500])
        return json.loads(text)

    def post_json(self, path: str, body: dict) -> tuple[int, Any]:
        r = self.client.post(self.base + path, json=body)
        text = r.text if isinstance(getattr(r, "text", None), str) else r.get_data(as_text=True)
        return r.status_code, json.loads(text) if r.status_code == 200 else text


def _split_output(output: str) -> list[dict[str, str]]:
    parts = output[2:-2].split("...") if output.startswith("..") else [output]
    return [dict(zip(("id", "property"), p.rsplit(".", 1), strict=True)) for p in parts]


def call_callback(http: _Http, prefix: str, first_output: str, values: dict[str, Any]) -> dict[str, Any]:
    """Run the callback whose outputs include ``first_output`` ("id.prop"); ``values`` maps
    "id.prop" of its inputs and states to values. Returns ``{id: {prop: value}}`` of what it set."""
    deps = http.get_json(prefix + "_dash-dependencies")
    (dep,) = [d for d in deps if first_output in d["output"].strip(".").split("...")]
    outputs = _split_output(dep["output"])
    inputs = [{**i, "value": values.get(f"{i['id']}.{i['property']}")} for i in dep["inputs"]]
    state = [{**s, "value": values.get(f"{s['id']}.{s['property']}")} for s in dep["state"]]
    body = {
        "output": dep["output"],
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": inputs,
        "state": state,
        "changedPropIds": [f"{i['id']}.{i['property']}" for i in dep["inputs"]],
    }
    status, data = http.post_json(prefix + "_dash-update-component", body)
    assert status == 200, (status, data)
    return data["response"]


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.config: dict[str, Any] | None = None
        self._in_config = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.urls.append(a["src"] or "")
        if tag == "link" and a.get("href"):
            self.urls.append(a["href"] or "")
        self._in_config = tag == "script" and a.get("id") == "_dash-config"

    def handle_data(self, data: str) -> None:
        if self._in_config:
            self.config = json.loads(data)
            self._in_config = False


def _parse_index(html: str) -> _Assets:
    p = _Assets()
    p.feed(html)
    assert p.config is not None, "no _dash-config in the index page"
    return p


def _strings(obj: Any) -> list[str]:
    """Every string inside a JSON-like value (to search component trees)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --------------------------------------------------------------------------------------------------
# Mounted in FastAPI (the controller's way)
# --------------------------------------------------------------------------------------------------


def test_mounted_under_dashboard_prefix(dashboard_site: Site) -> None:
    abc, new = dashboard_site.demo.abc, dashboard_site.demo.new
    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        http = _Http(client)
        r = client.get("/dashboard/")
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        index = _parse_index(r.text)
        assert index.config["requests_pathname_prefix"] == "/dashboard/"
        assert index.config["url_base_pathname"] is None

        # Every script and stylesheet the browser will load is under the prefix and served.
        local = [u for u in index.urls if not u.startswith(("http:", "https:", "//"))]
        assert any("_dash-component-suites" in u for u in local), local
        for url in local:
            assert url.startswith("/dashboard/"), url
            status, _ = http.get(url)
            assert status == 200, (url, status)

        hrefs = {s for s in _strings(http.get_json("/dashboard/_dash-layout")) if s.startswith("/dashboard")}
        assert {"/dashboard/", "/dashboard/nodes", "/dashboard/compare", "/dashboard/events",
                "/dashboard/signin"} <= hrefs

        # The API beside the mount still answers.
        assert client.get("/api/v1/jobs", headers=dashboard_site.headers()).json()["count"] == 2

        # Dash's page router strips the request prefix: /dashboard/jobs/<id> is the job page.
        routed = call_callback(
            http,
            "/dashboard/",
            "_pages_content.children",
            {"_pages_location.pathname": f"/dashboard/jobs/{abc}"},
        )
        content = routed["_pages_content"]["children"]
        assert abc in _strings(content)
        assert "job-detail-interval" in _strings(content)

        # The jobs callback reads the API through the client, with the token.
        resp = call_callback(http, "/dashboard/", "jobs-table.children", {"jobs-interval.n_intervals": 0})
        table = _strings(resp["jobs-table"]["children"])
        assert f"/dashboard/jobs/{abc}" in table and f"/dashboard/jobs/{new}" in table
        assert "pydoc-dsm" in table
        assert resp["jobs-count"]["children"] == "2 jobs"
        assert "jobs-error" not in resp or not _strings(resp["jobs-error"])

    # ... and it needs that token: the controller refuses a dashboard without one.
    tokenless = create_dash_app(dashboard_site.url, requests_pathname_prefix="/")
    resp = call_callback(
        _Http(tokenless.server.test_client()), "/", "jobs-table.children", {"jobs-interval.n_intervals": 0}
    )
    assert "jobs-table" not in resp
    assert any("controller answered 401" in s for s in _strings(resp["jobs-error"])), resp


def _job_refresh(http: _Http, job_id: str, cursor: Any = None, n: int = 0) -> dict[str, Any]:
    """One tick of the job page's header-and-overview callback."""
    return call_callback(http, "/dashboard/", "job-detail-loss.figure", {
        "job-detail-interval.n_intervals": n, "job-detail-id.data": job_id, "job-detail-cursor.data": cursor})


def _job_tab(http: _Http, job_id: str, cursor: Any, tab: str, rank: int | None = None) -> dict[str, Any]:
    """The job page's open-tab callback for ``tab``."""
    return call_callback(http, "/dashboard/", "job-detail-heatmap.figure", {
        "job-detail-cursor.data": cursor, "job-detail-tabs.value": tab, "job-detail-rank.value": rank,
        "job-detail-id.data": job_id})


def test_job_callback_found_and_not_found(dashboard_site: Site) -> None:
    abc = dashboard_site.demo.abc
    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        http = _Http(client)
        found = _job_refresh(http, abc)
        loss = found["job-detail-loss"]["figure"]
        assert [t["name"] for t in loss["data"]][:2] == ["train loss", "validation loss"]
        assert loss["data"][0]["x"] == list(range(20))  # job-wide: one point per step, whichever ranks
        bands = found["job-detail-step-time"]["figure"]
        assert [t["name"] for t in bands["data"]] == ["p50", "p90", "max (slowest rank)"]
        assert "rank 2" in bands["layout"]["title"]["text"]  # the straggler, named
        assert found["job-detail-slowest"]["rowData"][0]["rank"] == 2
        assert found["job-detail-interval"]["disabled"] is False  # RUNNING: keep polling
        assert "RUNNING" in _strings(found["job-detail-summary"]["children"])
        cursor = found["job-detail-cursor"]["data"]
        assert cursor["job_id"] == abc and cursor["last_step"] == 19

        heat = _job_tab(http, abc, cursor, "ranks")["job-detail-heatmap"]["figure"]["data"][0]
        assert heat["type"] == "heatmap" and heat["y"] == ["rank 0", "rank 1", "rank 2"]
        events = _job_tab(http, abc, cursor, "events")["job-detail-events"]["rowData"]
        assert "slow_rank at step 10000 on rank 2" in [e["message"] for e in events]

        missing = _job_refresh(http, "no-such-job")
        assert "job not found" in _strings(missing["job-detail-summary"]["children"])
        assert missing["job-detail-body"]["style"] == {"display": "none"}
        assert missing["job-detail-interval"]["disabled"] is True  # stop polling a missing job
        assert "job-detail-loss" not in missing  # figures left as they were


def test_pending_job_without_data_shows_waiting_figures(dashboard_site: Site) -> None:
    new = dashboard_site.demo.new
    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        http = _Http(client)
        resp = _job_refresh(http, new)
        tab = _job_tab(http, new, resp["job-detail-cursor"]["data"], "ranks")
    figs = [resp[g]["figure"] for g in ("job-detail-loss", "job-detail-throughput", "job-detail-step-time")]
    for fig in [*figs, tab["job-detail-heatmap"]["figure"]]:
        assert fig["data"] == []
        assert [a["text"] for a in fig["layout"]["annotations"]] == ["waiting for data"]


# --------------------------------------------------------------------------------------------------
# Standalone, several apps, errors
# --------------------------------------------------------------------------------------------------


def test_unreachable_controller_shows_error_instead_of_failing() -> None:
    app = create_dash_app(_closed_port_url(), requests_pathname_prefix="/")
    http = _Http(app.server.test_client())
    resp = call_callback(http, "/", "jobs-table.children", {"jobs-interval.n_intervals": 3})
    assert "jobs-table" not in resp  # the last table stays
    assert any("controller unreachable" in s for s in _strings(resp["jobs-error"]))
    resp = call_callback(http, "/", "nodes-grid.rowData", {"nodes-interval.n_intervals": 0})
    assert "nodes-grid" not in resp  # the last rows stay
    assert any("controller unreachable" in s for s in _strings(resp["nodes-error"]))
    resp = call_callback(
        http, "/", "job-detail-loss.figure", {"job-detail-interval.n_intervals": 0, "job-detail-id.data": "j"}
    )
    assert any("controller unreachable" in s for s in _strings(resp["job-detail-error"]))
    assert resp["job-detail-interval"]["disabled"] is False  # keep trying


def test_two_apps_in_one_process_each_keep_callbacks_and_config(dashboard_site: Site) -> None:
    # ``dashboard_site`` already created (and served) one app; build a second, standalone one, and
    # use the second before the first has served a callback request.
    standalone = create_dash_app(_closed_port_url(), requests_pathname_prefix="/")
    s_http = _Http(standalone.server.test_client())
    resp = call_callback(s_http, "/", "jobs-table.children", {"jobs-interval.n_intervals": 0})
    assert "jobs-error" in resp
    assert {"/", "/nodes", "/compare", "/events", "/signin"} <= set(_strings(s_http.get_json("/_dash-layout")))

    with httpx.Client(base_url=dashboard_site.url, timeout=30) as client:
        resp = call_callback(
            _Http(client), "/dashboard/", "jobs-table.children", {"jobs-interval.n_intervals": 0}
        )
    assert f"/dashboard/jobs/{dashboard_site.demo.abc}" in _strings(resp["jobs-table"]["children"])


def test_every_polling_callback_holds_its_timer_while_it_runs() -> None:
    """What the browser is told: whatever fires a page's refresh also runs, in the browser, a hold
    that sets the page's timer to BUSY_POLL_MS, and the refresh's reply sets the app's period back,
    so no tick cancels a slow refresh (plotly/dash#941; the browser test is test_slow_controller.py)."""
    app = create_dash_app(_closed_port_url(), requests_pathname_prefix="/", refresh_ms=700)
    http = _Http(app.server.test_client())
    holds: dict[str, str] = {}  # trigger -> timer whose period a clientside callback sets
    replies: dict[str, str] = {}  # trigger -> timer whose period a server callback sets back
    for dep in http.get_json("/_dash-dependencies"):
        for out in dep["output"].strip(".").split("..."):
            target = out.split("@")[0]
            if target.endswith("-interval.interval"):
                first = dep["inputs"][0]
                kind = holds if dep.get("clientside_function") else replies
                kind[f"{first['id']}.{first['property']}"] = target.removesuffix(".interval")
    timers = ("jobs-interval", "job-detail-interval", "nodes-interval", "node-detail-interval", "compare-interval",
              "events-interval")
    expected = {f"{t}.n_intervals": t for t in timers} | {"job-detail-cursor.data": "job-detail-interval"}
    assert holds == expected
    assert replies == expected
    status, index = http.get("/")
    assert status == 200 and f"return {BUSY_POLL_MS};" in index

    # A reply, even one that could not reach the controller, sets the app's period back.
    resp = call_callback(http, "/", "jobs-table.children", {"jobs-interval.n_intervals": 3})
    assert resp["jobs-interval"]["interval"] == 700
    resp = call_callback(
        http, "/", "job-detail-loss.figure", {"job-detail-interval.n_intervals": 0, "job-detail-id.data": "j"}
    )
    assert resp["job-detail-interval"] == {"disabled": False, "interval": 700}


def test_standalone_prefix_and_argument_checks() -> None:
    app = create_dash_app("http://127.0.0.1:1/", requests_pathname_prefix="/")
    status, text = _Http(app.server.test_client()).get("/")
    assert status == 200
    assert _parse_index(text).config["requests_pathname_prefix"] == "/"
    assert _normalise_prefix("vigil") == "/vigil/"
    assert _normalise_prefix("/dashboard") == "/dashboard/"
    with pytest.raises(ValueError, match="api_base_url"):
        create_dash_app("")
    with pytest.raises(ValueError, match="refresh_ms"):
        create_dash_app("http://x", refresh_ms=10)


def test_main_serves_standalone_at_root(tmp_path: Path) -> None:
    """``python -m dashboard --controller URL --port P`` serves the app at ``/`` until stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "dashboard.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--controller", _closed_port_url(), "--port", str(port)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "dashboard.log").read_text()) from None
                time.sleep(0.2)
        assert r.status_code == 200
        assert _parse_index(r.text).config["requests_pathname_prefix"] == "/"
        assert httpx.get(f"http://127.0.0.1:{port}/_dash-layout", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


# --------------------------------------------------------------------------------------------------
# Dependency hygiene
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import dashboard.app, sys; assert 'torch' not in sys.modules and 'ray' not in sys.modules",
        # Building the app executes every page module; still no torch, ray or trainer.
        (
            "import sys; from dashboard.app import create_dash_app; import dashboard.figures, dashboard.tables;"
            " create_dash_app('http://127.0.0.1:1');"
            " bad = sorted(m for m in sys.modules if re.match(r'(torch|ray|trainer)(\\.|$)', m));"
            " assert not bad, bad"
        ),
    ],
    ids=["import", "create-app"],
)
def test_dashboard_imports_neither_torch_nor_ray(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import re; " + code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_dashboard_sources_do_not_import_forbidden_packages() -> None:
    pattern = re.compile(r"^\s*(?:import|from)\s+(torch|ray|trainer)\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(REPO)) for p in (REPO / "dashboard").rglob("*.py") if pattern.search(p.read_text())
    ]
    assert not offenders
