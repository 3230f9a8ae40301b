"""Attacks on the dashboard from another site: a page elsewhere makes the signed-in user's browser post a
Dash callback (the confirmed actions: cancel, recover, faults, evict) to the dashboard.

Finding (issue 23): no Origin check on the dashboard's actions. Every POST whose ``Origin`` is not the
dashboard's own host is now refused (403) before Dash sees it. The test failed before the fix; the app is the
real dashboard (its Flask server), the controller behind it is not reached."""

from __future__ import annotations

import pytest

from dashboard.app import create_dash_app


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    return create_dash_app("http://127.0.0.1:9", token=None, requests_pathname_prefix="/").server.test_client()


@pytest.mark.parametrize("origin", ["http://evil.example", "http://127.0.0.1.evil.example", "null",
                                    "http://localhost:1"])
def test_a_callback_posted_from_another_site_is_refused(server, origin: str) -> None:  # type: ignore[no-untyped-def]
    r = server.post("/_dash-update-component", json={"output": "x.children", "inputs": []},
                    headers={"Origin": origin}, base_url="http://localhost")
    assert r.status_code == 403 and b"refused" in r.data


def test_the_dashboards_own_pages_still_post(server) -> None:  # type: ignore[no-untyped-def]
    for headers in ({"Origin": "http://localhost"}, {}):
        r = server.post("/_dash-update-component", json={"output": "x.children", "inputs": []}, headers=headers,
                        base_url="http://localhost")
        assert r.status_code != 403 and b"refused" not in r.data, (headers, r.status_code)
    assert server.get("/", base_url="http://localhost").status_code == 200
