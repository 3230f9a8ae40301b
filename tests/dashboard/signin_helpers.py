"""Signing in to the dashboard as the tests do, for the dashboard tests.

* over HTTP, as the browser's renderer does: :func:`run_callback` calls one Dash callback through
  ``_dash-update-component`` (the one ``match`` picks from ``_dash-dependencies``; :func:`by_input`
  picks it by an input's id), and :func:`sign_in` is the sign-in page's callback with a pasted token;
* in a real Chromium: :func:`browser_sign_in` pastes a token on ``/signin`` and waits for the badge.

Needs: the dashboard served under :data:`PREFIX` (``/dashboard/``) by a live controller (the
``dashboard_site`` fixture of conftest.py, or one built the same way) and an ``httpx.Client`` on its
base URL; for :func:`browser_sign_in`, a :class:`tests.dashboard.harness.Browser` page (Chromium,
chromedriver, selenium).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.dashboard.conftest import Site
from tests.dashboard.harness import Browser

PREFIX = "/dashboard/"


def _deps(client: httpx.Client) -> list[dict[str, Any]]:
    r = client.get(PREFIX + "_dash-dependencies")
    assert r.status_code == 200
    return r.json()


def _parts(output: str) -> list[dict[str, str]]:
    parts = output[2:-2].split("...") if output.startswith("..") else [output]
    return [dict(zip(("id", "property"), p.rsplit(".", 1), strict=True)) for p in parts]


def run_callback(
    client: httpx.Client, match: Callable[[dict[str, Any]], bool], values: dict[str, Any]
) -> tuple[httpx.Response, dict[str, Any]]:
    """Call the one callback ``match`` picks from the app's dependencies; ``values`` maps "id.prop" of
    its inputs and states. Returns the raw response (to search it) and its ``response`` part. Only the
    server's callbacks are candidates: a clientside one (a page timer's hold) runs in the browser."""
    (dep,) = [d for d in _deps(client) if not d.get("clientside_function") and match(d)]
    outputs = _parts(dep["output"])
    body = {
        "output": dep["output"],
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": [{**i, "value": values.get(f"{i['id']}.{i['property']}")} for i in dep["inputs"]],
        "state": [{**s, "value": values.get(f"{s['id']}.{s['property']}")} for s in dep["state"]],
        "changedPropIds": [k for k in values if any(f"{i['id']}.{i['property']}" == k for i in dep["inputs"])],
    }
    r = client.post(PREFIX + "_dash-update-component", json=body)
    assert r.status_code in (200, 204), (r.status_code, r.text[:500])
    return r, (r.json()["response"] if r.status_code == 200 else {})


def by_input(component_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda d: any(i["id"] == component_id for i in d["inputs"])


def sign_in(client: httpx.Client, token: str) -> tuple[httpx.Response, dict[str, Any]]:
    return run_callback(client, by_input("signin-submit"),
                        {"signin-submit.n_clicks": 1, "signin-token.value": token})


def browser_sign_in(page: Browser, site: Site, token: str, role: str = "user") -> None:
    """Sign in through the page as a person does: paste, click, wait for the badge."""
    page.get(f"{site.dashboard}signin")
    (field,) = page.wait_css("#signin-token")
    page.wait_for(lambda: page.text("app-auth-badge"), what="badge")
    field.send_keys(token)
    page.css("#signin-submit")[0].click()
    page.wait_equal(lambda: page.text("app-auth-badge"), f"signed in as {role}", what="badge after sign-in")
