"""What one refresh of a job's dashboard page costs, measured in a real browser against a real controller.

``vigil bench dashboard [--json] [--ranks 64,1024,10000] [--steps 200] [--collectives 1] [--ticks 3]
[--tab training|ranks|...]``

Per rank count: a real controller (``vigil controller`` as a subprocess, SQLite, the dashboard mounted
at ``/dashboard`` as in production) is fed a job of ``--ranks`` ranks x ``--steps`` steps through the
real ingest endpoint (each rank: one step sample and ``--collectives`` collective calls per step, one
straggler rank; the bodies of ``vigil bench ingest``), its aggregates are let to catch up, then
Debian's Chromium opens the job page (on ``--tab``; the browser's draw time and the check that the new
step was drawn are read on the Training tab only). Measured from the browser's own Resource Timing entries of
Dash's callback requests (``_dash-update-component``):

* the first load of the page (``first_load_bytes``, ``first_load_server_s``): the whole history;
* then ``--ticks`` live refreshes: before each, every rank reports one more step (as a running job
  does), and the refresh the page's timer fires next is measured: ``bytes_per_refresh`` (bytes
  received, the median over ticks), ``server_s_per_refresh`` (the summed time from each request's
  start to its first response byte: the dashboard's callbacks and the controller reads they make),
  ``decoded_bytes_per_refresh`` (the same, uncompressed), ``browser_draw_s`` (from the last response of
  the tick to the first animation frame in which the loss graph shows the new step: Dash applying the
  answer and Plotly redrawing, the browser's own work).

JSON (``--json``): a list with one object per rank count: ``tab``, ``ranks``, ``steps``, ``server_s_per_refresh``,
``bytes_per_refresh``, ``browser_draw_s``, plus ``first_load_bytes``, ``first_load_server_s``,
``requests_per_refresh``, ``page_errors`` (error banners on the page after the ticks, summed: a refresh that
failed, e.g. the controller did not answer within the dashboard's timeout, is cheap and must not pass for a
fast one), ``stale_refreshes`` (ticks after which the loss curve's last step was not the step just
reported: a refresh that drew nothing new must not pass for a cheap one), ``samples``, ``ingest_s``, ``aggregate_s``, ``ticks``.

Needs: ``apt-get install -y chromium chromium-driver`` and selenium (``make browser``; the test extras).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from ops.bench.ingest import controller_process
from ops.bench.ingest_db import _database, _dirty_steps, _tokens
from ops.bench.ingest_load import build_bodies

log = logging.getLogger(__name__)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CALLBACK_PATH = "_dash-update-component"
TABS = ("training", "ranks", "breakdown", "communication", "incidents", "checkpoints", "goodput", "events")
"""The job page's tabs (``job-detail-tab-<name>``)."""
REFRESH_MS = 2000
"""The mounted dashboard's refresh period (``dashboard.context.REFRESH_MS``)."""

# Watches, frame by frame, for the loss graph to show step ``arguments[0]``; records when (the frame after
# Plotly applied and rendered the refresh: JavaScript runs one thing at a time).
_WATCH_JS = """
var want = arguments[0];
window.__vigilSeen = null;
(function poll() {
  var gd = document.querySelector('#job-detail-loss .js-plotly-plot');
  var x = gd && gd.data && gd.data.length && gd.data[0].x;
  if (x && x.length && x[x.length - 1] === want) { window.__vigilSeen = performance.now(); return; }
  requestAnimationFrame(poll);
})();
"""
_LAST_X_JS = """
var gd = document.querySelector('#job-detail-loss .js-plotly-plot');
if (!gd || !gd.data || !gd.data.length || !gd.data[0].x || !gd.data[0].x.length) { return null; }
return gd.data[0].x[gd.data[0].x.length - 1];
"""
_ENTRIES_JS = """
var path = arguments[0];
return performance.getEntriesByType('resource')
  .filter(function (e) { return e.name.indexOf(path) >= 0; })
  .map(function (e) { return {start: e.startTime, req: e.requestStart, first: e.responseStart,
                               end: e.responseEnd, bytes: e.encodedBodySize, decoded: e.decodedBodySize,
                               transfer: e.transferSize}; });
"""


@dataclass
class Row:
    tab: str
    ranks: int
    steps: int
    server_s_per_refresh: float
    bytes_per_refresh: int
    browser_draw_s: float
    decoded_bytes_per_refresh: int
    first_load_bytes: int
    first_load_server_s: float
    requests_per_refresh: int
    page_errors: int
    stale_refreshes: int
    samples: int
    ingest_s: float
    aggregate_s: float
    ticks: int


@contextmanager
def _chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:  # pragma: no cover - the test extras install it
        raise SystemExit(f"bench dashboard needs selenium (pip install -e .[test]): {exc}") from exc
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        raise SystemExit("bench dashboard needs Debian's chromium and chromium-driver (make browser)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", f"--window-size={width},{height}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(120)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _post_all(base: str, agent_token: str, bodies: list[bytes], concurrency: int = 4) -> None:
    work = list(reversed(bodies))
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        headers = {"Authorization": f"Bearer {agent_token}", "Content-Encoding": "gzip",
                   "Content-Type": "application/json"}
        with httpx.Client(base_url=base, timeout=120) as client:
            while True:
                with lock:
                    if not work:
                        return
                    body = work.pop()
                r = client.post("/api/v1/telemetry", content=body, headers=headers)
                if r.status_code != 200:
                    with lock:
                        errors.append(f"HTTP {r.status_code}: {r.text[:300]}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} telemetry posts failed, first: {errors[0]}")


def _one_more_step(job_id: str, ranks: int, step: int, tick: int) -> bytes:
    """Every rank's next step, as one gzip batch of a fresh agent id (its own sequence)."""
    import gzip

    now = time.time()
    items = [
        (f'{{"kind":"step","job_id":"{job_id}","rank":{r},"world_size":{ranks},"step":{step},"ts":{now:.3f},'
         f'"loss":{3.0 - step * 1e-3:.4f},"tokens":512,"step_time_s":{0.15 if r == ranks - 1 else 0.1},'
         f'"tokens_per_s":4096.0,"data_s":0.002,"fwd_bwd_s":0.06,"optim_s":0.004,"comm_s":0.02}}')
        for r in range(ranks)
    ]
    body = (f'{{"agent_id":"bench-tick-{tick}","node_id":"bench-node-0","seq":0,"sent_at":{now:.3f},'
            f'"samples":[' + ",".join(items) + "]}")
    return gzip.compress(body.encode(), compresslevel=1)


def _entries(driver: Any) -> list[dict[str, float]]:
    return list(driver.execute_script(_ENTRIES_JS, CALLBACK_PATH))


def _settled(driver: Any, quiet_s: float = 0.8, timeout_s: float = 120.0) -> list[dict[str, float]]:
    """Callback entries once none was added for ``quiet_s`` (the page's callbacks have all answered)."""
    deadline = time.monotonic() + timeout_s
    last_n, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(_entries(driver))
        if n != last_n:
            last_n, last_change = n, time.monotonic()
        elif n > 0 and time.monotonic() - last_change >= quiet_s:
            return _entries(driver)
        time.sleep(0.1)
    raise TimeoutError("the page's callbacks did not settle")


def _tick_entries(entries: list[dict[str, float]], since_ms: float) -> list[dict[str, float]]:
    """The requests of the first refresh that started after ``since_ms`` (those within one period of it)."""
    later = sorted((e for e in entries if e["start"] >= since_ms), key=lambda e: e["start"])
    if not later:
        return []
    first = later[0]["start"]
    return [e for e in later if e["start"] < first + 0.75 * REFRESH_MS]


def measure(ranks: int, steps: int, collectives: int, ticks: int, tab: str = "training") -> Row:
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-dashboard-"))
    try:
        with _database("sqlite", home) as url:
            admin, agent = _tokens(url)
            with controller_process(url, home) as base:
                job = httpx.post(f"{base}/api/v1/jobs", json={"name": f"bench-dashboard-{ranks}", "steps": 100_000},
                                 headers={"Authorization": f"Bearer {admin}"}, timeout=30)
                job.raise_for_status()
                job_id = job.json()["id"]
                samples = ranks * (1 + collectives) * steps
                agents = max(1, min(16, ranks // 64))
                log.info("%d ranks: building %d samples", ranks, samples)
                bodies = build_bodies(job_id, ranks, collectives, samples, agents, 2000)
                t0 = time.perf_counter()
                _post_all(base, agent, bodies)
                ingest_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                while _dirty_steps(url) > 0 and time.perf_counter() - t1 < 600:
                    time.sleep(0.5)
                aggregate_s = time.perf_counter() - t1
                log.info("%d ranks: ingest %.1f s, aggregates %.1f s", ranks, ingest_s, aggregate_s)
                with _chromium() as driver:
                    driver.get(f"{base}/dashboard/jobs/{job_id}")
                    driver.execute_script("performance.setResourceTimingBufferSize(100000);")
                    first = _settled(driver)
                    if tab != "training":  # the page opens on Training; another tab: its own first load
                        driver.execute_script("performance.clearResourceTimings();")
                        driver.find_element("id", f"job-detail-tab-{tab}").click()
                        first = _settled(driver)
                    first_bytes = int(sum(e["bytes"] for e in first))
                    first_server = sum(max(0.0, e["first"] - e["req"]) for e in first) / 1e3
                    per_tick: list[tuple[int, float, float, int, int]] = []
                    errors = 0
                    stale = 0
                    for tick in range(ticks):
                        _post_all(base, agent, [_one_more_step(job_id, ranks, steps + tick, tick)], 1)
                        driver.execute_script("performance.clearResourceTimings();")
                        if tab == "training":
                            driver.execute_script(_WATCH_JS, steps + tick)
                        mark = float(driver.execute_script("return performance.now();"))
                        deadline = time.monotonic() + 3 * REFRESH_MS / 1e3 + 30
                        got: list[dict[str, float]] = []
                        while time.monotonic() < deadline:
                            time.sleep(REFRESH_MS / 1e3)
                            got = _tick_entries(_entries(driver), mark)
                            if got and all(e["end"] > 0 for e in got):
                                time.sleep(1.0)  # let the draw finish
                                got = _tick_entries(_entries(driver), mark)
                                break
                        if not got:
                            raise TimeoutError("no refresh seen")
                        seen = driver.execute_script("return window.__vigilSeen;")
                        log.debug("tick %d: seen %s, requests %s", tick, seen, got)
                        # From the answer that brought the step (the last one to end before it showed; a
                        # chained callback may answer after the draw) to the frame that showed it.
                        seen = seen if tab == "training" else None
                        before = [e["end"] for e in got if seen is not None and e["end"] <= float(seen)]
                        draw_s = (float(seen) - max(before)) / 1e3 if before else 0.0
                        shown = driver.execute_script(_LAST_X_JS) if tab == "training" else steps + tick
                        if shown != steps + tick:
                            stale += 1
                        errors += int(driver.execute_script(
                            "return document.querySelectorAll('.vigil-error').length;"))
                        per_tick.append((int(sum(e["bytes"] for e in got)),
                                         sum(max(0.0, e["first"] - e["req"]) for e in got) / 1e3, draw_s, len(got),
                                         int(sum(e["decoded"] for e in got))))
        return Row(
            tab=tab, ranks=ranks, steps=steps,
            server_s_per_refresh=round(statistics.median(t[1] for t in per_tick), 3),
            bytes_per_refresh=int(statistics.median(t[0] for t in per_tick)),
            browser_draw_s=round(statistics.median(t[2] for t in per_tick), 3),
            decoded_bytes_per_refresh=int(statistics.median(t[4] for t in per_tick)),
            first_load_bytes=first_bytes, first_load_server_s=round(first_server, 3),
            requests_per_refresh=int(statistics.median(t[3] for t in per_tick)), page_errors=errors,
            stale_refreshes=stale,
            samples=samples, ingest_s=round(ingest_s, 1), aggregate_s=round(aggregate_s, 1), ticks=ticks,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vigil bench dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--ranks", default="64,1024,10000", help="comma-separated rank counts")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--collectives", type=int, default=1, help="collective calls per rank and step")
    ap.add_argument("--ticks", type=int, default=3, help="live refreshes measured per rank count")
    ap.add_argument("--tab", default="training", choices=TABS,
                    help="the job page's tab open while measuring (default: training, the one it opens on)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not counts or min(counts) < 1 or args.steps < 1 or args.ticks < 1 or args.collectives < 0:
        ap.error("--ranks, --steps and --ticks must be positive, --collectives >= 0")
    rows = [measure(n, args.steps, args.collectives, args.ticks, args.tab) for n in counts]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(f"{'ranks':>6} {'steps':>5} {'server s':>9} {'bytes':>10} {'draw s':>7} {'first load':>11}")
        for r in rows:
            print(f"{r.ranks:>6} {r.steps:>5} {r.server_s_per_refresh:>9.3f} {r.bytes_per_refresh:>10} "
                  f"{r.browser_draw_s:>7.3f} {r.first_load_bytes:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
