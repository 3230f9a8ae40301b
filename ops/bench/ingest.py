"""Telemetry ingest throughput of a real controller (uvicorn subprocess) on SQLite and PostgreSQL.

``vigil bench ingest [--json] [--ranks N] [--collectives K] [--samples S] [--backend sqlite|postgresql|both]
[--format columnar|json] [--workers N]``

A load generator plays ``--agents`` node agents of a job with ``--ranks`` ranks and ``--collectives``
collective calls per rank and step: every rank reports a StepSample and K CollectiveSamples per step,
each agent for its slice of the ranks, in gzip batches of ``--batch`` samples (the agent's default
2,000), numbered per agent, encoded as the agents encode them (``--format``: ``columnar``, the
default, to ``POST /telemetry/columnar``; ``json`` to ``POST /telemetry``), posted with an agent token by ``--concurrency`` connections at once,
as fast as the controller acknowledges them. The bodies are built before the clock starts, so the
generator costs the controller's CPUs as little as possible.

Per backend: sustained ``samples_per_s`` (samples acknowledged as stored / wall time from the first
post to the last answer), ``p99_latency_ms`` of one post, and ``bytes_per_million_samples``: growth
of the database (SQLite: pages after a WAL checkpoint; PostgreSQL: ``pg_database_size``) per million
samples stored. The controller's aggregation pass runs meanwhile as in production; the JSON also
says how long the aggregates took to catch up after the last post (``aggregate_lag_s``). With
``--no-aggregate-during`` the pass is held during the run (raw ingest alone) and ``aggregate_lag_s``
is the time one thread then takes to aggregate everything that was sent.

JSON (``--json``): a list with one object per backend: ``backend``, ``ranks``, ``samples_per_s``,
``p99_latency_ms``, ``bytes_per_million_samples``, plus ``samples``, ``batches``, ``p50_latency_ms``,
``seconds``, ``aggregate_lag_s``, ``collectives``, ``concurrency``, ``batch``, ``controller_cpu_s`` (CPU time
the controller process and its children, the aggregation process among them, used while the posts ran) and
``samples_per_controller_cpu_s`` (the throughput one free core would give; this machine is shared, so
the wall-clock figure depends on what else runs: ``load_average`` is the 1-minute load at the end).

What bounds it: ``db_bound_samples_per_s`` is the database's own rate for the same rows, measured in
the same run, after the posts (so that its garbage and its writeback do not weigh on them), on a fresh
database of the same backend: :func:`controller.telemetry.bulk_insert` of the
batches' rows, one transaction per batch, one connection, no HTTP and no decoding (the rows are built
before each batch's clock starts). ``workers``: the controller's uvicorn worker processes
(``--workers``; ``controller_cpu_s`` sums them all). The job is marked running, so the monitor runs
its detectors on it while the posts flood in; ``monitor_pass_s`` is the longest monitor pass seen
during the run (read from ``vigil_monitor_pass_seconds`` / ``vigil_monitor_last_pass_seconds`` on
``/metrics`` once a second: :class:`~ops.bench.ingest_watch.MonitorWatch`), ``monitor_pass_p50_s`` the median,
``monitor_passes`` how many ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ops.bench.ingest_db import (
    _aggregate_all,
    _database,
    _db_bytes,
    _dirty_steps,
    _mark_running,
    _tokens,
    db_bound,
)
from ops.bench.ingest_load import build_bodies, build_columnar_bodies
from ops.bench.ingest_watch import MonitorWatch
from vigil.contract.probe import free_port

log = logging.getLogger(__name__)

@dataclass
class Result:
    backend: str
    ranks: int
    samples_per_s: float
    p99_latency_ms: float
    bytes_per_million_samples: float
    samples: int
    batches: int
    p50_latency_ms: float
    seconds: float
    aggregate_lag_s: float | None
    aggregate_during: bool
    collectives: int
    concurrency: int
    batch: int
    controller_cpu_s: float
    samples_per_controller_cpu_s: float
    load_average: float
    format: str = "columnar"
    workers: int = 1
    db_bound_samples_per_s: float | None = None
    monitor_pass_s: float | None = None
    monitor_pass_p50_s: float | None = None
    monitor_passes: int = 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children so far (the controller's own work,
    its worker processes included, whatever else runs)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return float(total)


@contextmanager
def controller_process(url: str, home: Path, pid_out: list[int] | None = None, aggregate: bool = True,
                       workers: int = 1) -> Iterator[str]:
    """``vigil controller`` on a free loopback port, stopped (and waited for) on exit."""
    port = free_port()
    env = dict(os.environ, VIGIL_HOME=str(home), VIGIL_DATABASE_URL=url, VIGIL_PORT=str(port),
               VIGIL_CONTROLLER_URL=f"http://127.0.0.1:{port}", PYTHONUNBUFFERED="1")
    env.pop("VIGIL_RAY_ADDRESS", None)
    if not aggregate:  # the aggregation pass sleeps through the run (measured afterwards on its own)
        env["VIGIL_TELEMETRY_INTERVAL_S"] = "100000"
        env["VIGIL_AGGREGATE_SETTLE_S"] = "100000"
    log_path = home / "controller.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "controller", "--port", str(port),
                                 "--workers", str(workers)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    if pid_out is not None:
        pid_out.append(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"controller exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("controller did not start")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_backend(backend: str, *, ranks: int, collectives: int, samples: int, agents: int, batch: int,
                concurrency: int, wait_aggregates: float, aggregate_during: bool = True, fmt: str = "columnar",
                workers: int = 1, measure_bound: bool = True) -> Result:
    home = Path(tempfile.mkdtemp(prefix="vigil-bench-ingest-"))
    try:
        with _database(backend, home) as url:
            admin, agent = _tokens(url)
            proc_pid: list[int] = []
            with controller_process(url, home, proc_pid, aggregate=aggregate_during, workers=workers) as base:
                job = httpx.post(f"{base}/api/v1/jobs", json={"name": "bench-ingest", "steps": 1000},
                                 headers={"Authorization": f"Bearer {admin}"}, timeout=30)
                job.raise_for_status()
                job_id = job.json()["id"]
                log.info("%s: building %d samples (%d ranks x %d collectives)", backend, samples, ranks, collectives)
                _mark_running(url, job_id)
                bodies = (build_columnar_bodies if fmt == "columnar" else build_bodies)(
                    job_id, ranks, collectives, samples, agents, batch)
                before = _db_bytes(url)
                posted = _post_all(base, admin, agent, bodies, fmt, concurrency, proc_pid[0])
                load = os.getloadavg()[0]
                lag = _aggregate_lag(url, aggregate_during, wait_aggregates)
            after = _db_bytes(url)
        latencies, stored, elapsed, cpu = sorted(posted.latencies), posted.stored, posted.elapsed, posted.cpu
        pass_max, pass_p50, passes = posted.watch.summary()
        bound = None
        if measure_bound:  # after the run: its garbage and its writeback would otherwise weigh on the run
            os.sync()
            log.info("%s: the database's own bound (bulk_insert, no HTTP)", backend)
            bound = db_bound(backend, home, ranks=ranks, collectives=collectives, samples=samples, agents=agents,
                             batch=batch)
        return Result(
            backend=backend, ranks=ranks, samples_per_s=round(stored / elapsed, 1),
            p99_latency_ms=round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            bytes_per_million_samples=round((after - before) * 1e6 / max(1, stored), 1),
            samples=stored, batches=len(bodies),
            p50_latency_ms=round(1e3 * latencies[len(latencies) // 2], 2), seconds=round(elapsed, 3),
            aggregate_lag_s=None if lag is None else round(lag, 2), aggregate_during=aggregate_during,
            collectives=collectives,
            concurrency=concurrency, batch=batch, controller_cpu_s=round(cpu, 2),
            samples_per_controller_cpu_s=round(stored / max(cpu, 1e-9), 1), load_average=round(load, 2),
            format=fmt, workers=workers, db_bound_samples_per_s=None if bound is None else round(bound, 1),
            monitor_pass_s=pass_max, monitor_pass_p50_s=pass_p50, monitor_passes=passes,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


@dataclass
class _Posted:
    """What posting every batch gave: each acknowledged post's latency, the samples stored, the wall and
    the controller's CPU seconds it took, and the monitor's passes meanwhile."""

    latencies: list[float]
    stored: int
    elapsed: float
    cpu: float
    watch: MonitorWatch


def _post_all(base: str, admin: str, agent: str, bodies: list[bytes], fmt: str, concurrency: int,
              controller_pid: int) -> _Posted:
    """Post ``bodies`` as the agents do, ``concurrency`` at once, as fast as the controller acknowledges them."""
    path = "/api/v1/telemetry/columnar" if fmt == "columnar" else "/api/v1/telemetry"
    ctype = "application/vnd.vigil.columnar+msgpack" if fmt == "columnar" else "application/json"
    work: queue.Queue[bytes] = queue.Queue()
    for b in bodies:
        work.put(b)
    latencies: list[float] = []
    stored = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        headers = {"Authorization": f"Bearer {agent}", "Content-Encoding": "gzip", "Content-Type": ctype}
        with httpx.Client(base_url=base, timeout=120) as client:
            while True:
                try:
                    body = work.get_nowait()
                except queue.Empty:
                    return
                t = time.perf_counter()
                r = client.post(path, content=body, headers=headers)
                dt = time.perf_counter() - t
                with lock:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}: {r.text[:300]}")
                        continue
                    latencies.append(dt)
                    stored[0] += r.json()["stored"]

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    cpu0 = _cpu_seconds(controller_pid)
    with MonitorWatch(base, admin) as watch:
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t0
        cpu = _cpu_seconds(controller_pid) - cpu0
    if errors:
        raise RuntimeError(f"{len(errors)} posts failed, first: {errors[0]}")
    return _Posted(latencies, stored[0], elapsed, cpu, watch)


def _aggregate_lag(url: str, aggregate_during: bool, wait_aggregates: float) -> float | None:
    """Seconds the aggregates took to catch up after the last post (held during the run: one thread's
    time to aggregate everything now); None when they did not within ``wait_aggregates``."""
    if not aggregate_during:
        return _aggregate_all(url)
    if wait_aggregates > 0:
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < wait_aggregates:
            if _dirty_steps(url) == 0:
                return time.perf_counter() - t1
            time.sleep(0.5)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vigil bench ingest", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--ranks", type=int, default=1000, help="simulated ranks (1..10000, default 1000)")
    ap.add_argument("--collectives", type=int, default=8, help="collective calls per rank and step (default 8)")
    ap.add_argument("--samples", type=int, default=1_000_000, help="samples to send per backend (default 1M)")
    ap.add_argument("--agents", type=int, default=8, help="simulated node agents (default 8)")
    ap.add_argument("--batch", type=int, default=2000, help="samples per batch (default 2000, the agent's)")
    ap.add_argument("--concurrency", type=int, default=4, help="posts in flight (default 4)")
    ap.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--no-aggregate-during", dest="aggregate_during", action="store_false",
                    help="hold the controller's aggregation pass during the run; aggregate_lag_s is then the time "
                         "one thread takes to aggregate everything afterwards")
    ap.add_argument("--format", choices=["columnar", "json"], default="columnar",
                    help="wire format of the batches (default columnar, what the agents send)")
    ap.add_argument("--workers", type=int, default=1, help="controller worker processes (default 1)")
    ap.add_argument("--no-db-bound", dest="db_bound", action="store_false",
                    help="skip measuring db_bound_samples_per_s (the database's own bulk-insert rate)")
    ap.add_argument("--wait-aggregates", type=float, default=120.0,
                    help="seconds to wait for the aggregates to catch up after the last post (0: do not)")
    args = ap.parse_args(argv)
    if not 1 <= args.ranks <= 10_000:
        ap.error("--ranks must be in [1, 10000]")
    if not 1 <= args.batch <= 10_000:
        ap.error("--batch must be in [1, 10000]")
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    results = [
        run_backend(b, ranks=args.ranks, collectives=args.collectives, samples=args.samples, agents=args.agents,
                    batch=args.batch, concurrency=args.concurrency, wait_aggregates=args.wait_aggregates,
                    aggregate_during=args.aggregate_during, fmt=args.format, workers=args.workers,
                    measure_bound=args.db_bound)
        for b in backends
    ]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{r.backend:<10} ranks {r.ranks:>6}  {r.samples_per_s:>10,.0f} samples/s  p99 {r.p99_latency_ms:8.1f} ms"
                  f"  {r.bytes_per_million_samples / 1e6:7.1f} MB per 1M samples  aggregates caught up "
                  f"{r.aggregate_lag_s}s after the last post  db bound {r.db_bound_samples_per_s} samples/s  "
                  "monitor pass max " + ("-" if r.monitor_pass_s is None else f"{r.monitor_pass_s}s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
