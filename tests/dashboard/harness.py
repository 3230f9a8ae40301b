"""Test harness for the dashboard: mounting it in the controller, and a real Chromium.

* :func:`mount_dashboard` mounts the dashboard in a controller app the way the controller does.
* :class:`Browser` drives Debian's Chromium through Debian's chromedriver with selenium (explicit
  ``Service("/usr/bin/chromedriver")``; never a browser or driver downloaded by a test tool), and
  reads Plotly graphs straight from their DOM nodes.

Needs: uvicorn, a2wsgi (mounting), selenium, and ``apt-get install -y chromium chromium-driver``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


# --------------------------------------------------------------------------------------------------
# Browser
# --------------------------------------------------------------------------------------------------


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or ``None`` when Chromium and its driver are installed."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not (p.exists() and os.access(p, os.X_OK))]
    if missing:
        return f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver"
    return None


_GRAPH_JS = """
const root = document.getElementById(arguments[0]);
const gd = root && (root.classList.contains('js-plotly-plot') ? root : root.querySelector('.js-plotly-plot'));
if (!gd || !gd.data) { return null; }
return {
  traces: gd.data.map(t => ({
    name: t.name === undefined ? null : t.name,
    type: t.type || 'scatter',
    x: Array.from(t.x || []),
    n: (t.x || []).length,
    rows: t.z ? t.z.length : null,
  })),
  annotations: ((gd.layout && gd.layout.annotations) || []).map(a => a.text),
};
"""

_RECORD_DASH_REQUESTS_JS = """
(() => {
  const log = [];
  window.__vigilDashRequests = log;
  const original = window.fetch.bind(window);
  window.fetch = (input, init) => {
    const url = String((input && input.url) || input);
    if (!url.includes('_dash-update-component')) { return original(input, init); }
    let output = '?';
    try { output = JSON.parse(init.body).output; } catch (e) {}
    const entry = {output: String(output).slice(0, 80), t0: Math.round(performance.now()), ms: null, status: 'pending'};
    log.push(entry);
    if (log.length > 500) { log.shift(); }
    return original(input, init).then(
      r => { entry.ms = Math.round(performance.now()) - entry.t0; entry.status = r.status; return r; },
      e => { entry.ms = Math.round(performance.now()) - entry.t0; entry.status = 'error ' + e; throw e; });
  };
})();
"""
"""Installed in every page: remembers the page's last Dash callback requests (output, start in ms
since the page loaded, duration, HTTP status or ``pending``) for :meth:`Browser.story`."""


class Browser:
    """A headless Chromium with helpers to wait on the page and read Plotly graphs."""

    def __init__(self, user_data_dir: Path) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={user_data_dir}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        self.driver.set_page_load_timeout(60)
        self.driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _RECORD_DASH_REQUESTS_JS})

    def quit(self) -> None:
        self.driver.quit()

    def get(self, url: str) -> None:
        self.driver.get(url)

    def blank(self) -> None:
        """Leave the current page (stops its polling) and drop its console messages."""
        self.driver.get("about:blank")
        self.console()

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        """Poll ``predicate`` until it returns something truthy; return that, or fail naming ``what``."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
            except Exception as exc:  # noqa: BLE001 - the page may be mid-render; keep the last error
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}\n{self.story()}")

    def story(self) -> str:
        """Where the browser is, what it shows and logged, and its last Dash callback requests (which
        were answered, how fast, which still wait): for a failure's message (CI keeps nothing else)."""
        try:
            body = self.js("return document.body ? document.body.innerText : null;")
            now = self.js("return Math.round(performance.now());")
            requests = self.js("return window.__vigilDashRequests || [];") or []
            latest = {r["output"]: r for r in requests}  # each callback's last request
            odd = [r for r in requests if r["status"] != 200 and latest[r["output"]] is not r]
            shown = [(r["output"][:60], r["t0"], r["ms"], r["status"])
                     for r in sorted(odd + list(latest.values()), key=lambda r: r["t0"])]
            return (f"url: {self.driver.current_url}\npage text: {str(body)[:1500]!r}\n"
                    f"console: {[m.get('message') for m in self.console()][-10:]}\n"
                    f"dash requests, each callback's last and any unanswered or failed (page at {now} ms; output, "
                    f"start ms, took ms, status): {shown}")
        except Exception as exc:  # noqa: BLE001 - a dead browser: say so, keep the original failure
            return f"(browser unreadable: {exc!r})"

    def wait_equal(
        self, getter: Callable[[], Any], expected: Any, timeout: float = 30.0, what: str = "value"
    ) -> None:
        """Poll ``getter`` until it returns ``expected``; on timeout, fail showing the last value."""
        seen: list[Any] = [None]

        def check() -> bool:
            seen[0] = getter()
            return bool(seen[0] == expected)

        try:
            self.wait_for(check, timeout, what)
        except AssertionError:
            raise AssertionError(
                f"{what}: expected {expected!r}, last saw {seen[0]!r} after {timeout} s"
            ) from None

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def css(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def wait_css(self, selector: str, timeout: float = 30.0) -> list[Any]:
        return self.wait_for(lambda: self.css(selector), timeout, f"element {selector!r}")

    def text(self, element_id: str) -> str:
        return self.js(
            "const e = document.getElementById(arguments[0]); return e ? e.innerText : null;", element_id
        )

    def graph(self, graph_id: str) -> dict[str, Any] | None:
        """Traces (name, type, x, n points, heatmap rows) and annotation texts of a ``dcc.Graph``."""
        return self.js(_GRAPH_JS, graph_id)

    def console(self) -> list[dict[str, Any]]:
        """Browser console messages since the last call."""
        return self.driver.get_log("browser")

    def console_errors(self) -> list[str]:
        return [
            m["message"]
            for m in self.console()
            if m.get("level") == "SEVERE" and "favicon" not in m["message"]
        ]


# --------------------------------------------------------------------------------------------------
# Mounting
# --------------------------------------------------------------------------------------------------


def mount_dashboard(api_app: Any, api_url: str, *, token: str | None = None, refresh_ms: int = 1000) -> None:
    """Mount the dashboard at ``/dashboard`` of ``api_app``, as the controller does, reading ``api_url``.

    Exactly the controller's mounting: ``app.mount("/dashboard", a2wsgi.WSGIMiddleware(dash_app.server))``
    with the dashboard's default ``requests_pathname_prefix="/dashboard/"``; the dashboard reads the
    API of the same server. Unlike the controller's own mount, the token and the refresh period are
    the test's.
    """
    from a2wsgi import WSGIMiddleware

    from dashboard.app import create_dash_app

    dash_app = create_dash_app(api_url, token=token, refresh_ms=refresh_ms)
    api_app.mount("/dashboard", WSGIMiddleware(dash_app.server))
