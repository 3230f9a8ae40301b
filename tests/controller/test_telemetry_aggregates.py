"""Per-step aggregates, the raw retention window, the series endpoints and Prometheus /metrics.

Runs the real app (``create_app``) on SQLite and PostgreSQL (``db_url``) with its telemetry
maintainer driven one pass at a time. Expected values are computed here from the definition
(wait = duration - fastest rank's duration of the same call), independently of the code.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from controller.aggregation import prune_raw
from controller.models import (
    CollectiveMetric,
    CollectiveStepStat,
    JobStepStat,
    RankStepStat,
    StepMetric,
    TelemetryBatchSeen,
    TelemetryDirtyStep,
)
from controller.step_aggregates import (
    COLL_ROW_FIELDS,
    STEP_ROW_FIELDS,
    compute_step,
    load_step,
    stored_history,
)
from tests.controller.samples import KINDS, coll_sample, random_run, step_sample
from tests.controller.telemetry_client import make_client, post
from vigil.contract.schemas import MAX_TELEMETRY_ITEMS

API = "/api/v1"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


def _job(client: TestClient) -> str:
    r = client.post(f"{API}/jobs", json={"name": "agg", "steps": 100})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _count(client: TestClient, model: type) -> int:
    with client.app.state.sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def expected(samples: list[dict]) -> tuple[dict, dict, dict]:
    """(per (step, kind), per (step, rank), per step) from the definition, latest sample wins."""
    calls: dict[tuple[int, int, int], dict] = {}
    steps: dict[tuple[int, int], dict] = {}
    for s in samples:
        if s["kind"] == "collective":
            calls[(s["step"], s["seq"], s["rank"])] = s
        else:
            steps[(s["step"], s["rank"])] = s
    fastest: dict[tuple[int, int], float] = {}
    for (st, q, _), c in calls.items():
        fastest[(st, q)] = min(fastest.get((st, q), 1e9), c["duration_s"])
    kind_rank: dict[tuple[int, tuple], dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    rank_tot: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for (st, q, r), c in calls.items():
        k = (c["op"], c["group"], c["tag"])
        w = c["duration_s"] - fastest[(st, q)]
        kind_rank[(st, k)][r][0] += c["duration_s"]
        kind_rank[(st, k)][r][1] += w
        t = rank_tot[(st, r)]
        t[0] += c["duration_s"]
        t[1] += w
        t[2] += 1
        t[3] += c["wire_bytes"]
    per_kind = {}
    for (st, k), per in kind_rank.items():
        durs = sorted(v[0] for v in per.values())
        per_kind[(st, k)] = {
            "p50_s": durs[(len(durs) - 1) // 2], "max_s": max(durs), "min_s": min(durs),
            "slowest_rank": max(per, key=lambda r: (per[r][0], -r)),
            "wait_max_s": max(v[1] for v in per.values()), "ranks": len(per),
            "transfer_s": sum(fastest[(st, q)] for (s2, q) in fastest if s2 == st and KINDS[q % 2] == k),
        }
    per_rank = {key: {"comm_wait_s": v[1], "collectives": v[2], "wire_bytes": v[3],
                      "step_time_s": steps[key]["step_time_s"] if key in steps else None}
                for key, v in rank_tot.items()}
    per_step: dict[int, dict] = {}
    for (st, r), v in per_rank.items():
        cur = per_step.setdefault(st, {"slowest": None, "max": -1.0})
        if v["step_time_s"] is not None and v["step_time_s"] > cur["max"]:
            cur["max"], cur["slowest"] = v["step_time_s"], r
    return per_kind, per_rank, per_step


def check_stored(client: TestClient, job: str, samples: list[dict]) -> None:
    per_kind, per_rank, per_step = expected(samples)
    with client.app.state.sessions() as s:
        kinds = s.scalars(select(CollectiveStepStat).where(CollectiveStepStat.job_id == job)).all()
        ranks = s.scalars(select(RankStepStat).where(RankStepStat.job_id == job)).all()
        jobs = s.scalars(select(JobStepStat).where(JobStepStat.job_id == job)).all()
    assert {(k.step, (k.op, k.group, k.tag)) for k in kinds} == set(per_kind)
    for k in kinds:
        e = per_kind[(k.step, (k.op, k.group, k.tag))]
        for f in ("p50_s", "max_s", "min_s", "wait_max_s", "transfer_s"):
            assert getattr(k, f) == pytest.approx(e[f], abs=1e-9), (f, k.step, k.op)
        assert (k.slowest_rank, k.ranks) == (e["slowest_rank"], e["ranks"])
    assert {(r.step, r.rank) for r in ranks} == set(per_rank)
    for r in ranks:
        e = per_rank[(r.step, r.rank)]
        assert r.comm_wait_s == pytest.approx(e["comm_wait_s"], abs=1e-9)
        assert (r.collectives, r.wire_bytes) == (e["collectives"], e["wire_bytes"])
        assert r.step_time_s == pytest.approx(e["step_time_s"])
    assert {j.step: j.slowest_rank for j in jobs} == {st: v["slowest"] for st, v in per_step.items()}


# --- aggregation --------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [False, True], ids=["every-call", "a-call-missing"])
def test_aggregates_follow_the_definition_and_both_paths_agree(client: TestClient, missing: bool) -> None:
    """Both database paths (each rank made every call: waits from the totals; a call missing on one
    rank: the per-row window) agree with the row-by-row definition."""
    job = _job(client)
    samples = random_run(job, ranks=4, steps=3, calls=5, seed=1)
    if missing:  # rank 2 never reported call 3 of step 1
        samples = [x for x in samples if not (x["kind"] == "collective" and x["rank"] == 2 and x["step"] == 1
                                              and x["seq"] == 3)]
    # Spread over batches from two agents, in an order that interleaves steps.
    half = len(samples) // 2
    post(client, samples[half:], 0, agent="a2", node="n2")
    post(client, samples[:half], 0)
    maint = client.app.state.telemetry
    assert maint.step(now=time.time()).aggregated_steps == 0  # not settled yet
    assert _count(client, TelemetryDirtyStep) == 3
    assert maint.step(now=time.time() + 10).aggregated_steps == 3
    assert _count(client, TelemetryDirtyStep) == 0
    check_stored(client, job, samples)
    # The database path (GROUP BY) and the row-by-row path give the same aggregates.
    with client.app.state.sessions() as s:
        for st in range(3):
            fast = load_step(s, job, st)
            # Rows read by name: the columns in any order give the same aggregates.
            rows_s = s.execute(select(*(getattr(StepMetric, f) for f in reversed(STEP_ROW_FIELDS)))
                               .where(StepMetric.job_id == job, StepMetric.step == st).order_by(StepMetric.id)).all()
            C = CollectiveMetric
            rows_c = s.execute(select(*(getattr(C, f) for f in reversed(COLL_ROW_FIELDS)))
                               .where(C.job_id == job, C.step == st).order_by(C.id)).all()
            slow = compute_step(job, st, rows_s, rows_c, stored_history(s.connection(), job, st))
            assert fast is not None and slow is not None
            assert fast.job == pytest.approx(slow.job)
            assert fast.ranks == [pytest.approx(r) for r in slow.ranks]
            assert fast.collectives == [pytest.approx(c) for c in slow.collectives]


def test_the_pass_wakes_when_the_earliest_dirty_step_settles(client: TestClient) -> None:
    maint = client.app.state.telemetry
    maint.process = None  # the passes in this process's thread (in the child, the same code decides)
    clock = [time.time()]
    maint.clock = lambda: clock[0]
    assert maint.pause_s() == maint.interval_s  # nothing dirty
    job = _job(client)
    post(client, random_run(job, ranks=2, steps=1, calls=1), 0)
    with client.app.state.sessions() as s:
        touched = s.scalar(select(TelemetryDirtyStep.touched_at))
    clock[0] = touched + maint.settle_s - 0.3  # settles in 0.3 s: the next pass then, not an interval later
    assert maint.pause_s() == pytest.approx(0.31)
    clock[0] = touched  # settles in settle_s (2 s): the interval (1 s) first
    assert maint.pause_s() == maint.interval_s
    clock[0] = touched + maint.settle_s + 5  # settled and still dirty (deferred): no busy loop
    assert maint.pause_s() == 0.5


def test_rerun_step_latest_samples_win(client: TestClient) -> None:
    job = _job(client)
    first = random_run(job, ranks=3, steps=2, calls=2, seed=2)
    post(client, first, 0)
    client.app.state.telemetry.flush()
    # Rank 1 restarts from a checkpoint and re-runs step 1 (its next run attempt), much slower this time.
    now = time.time()
    rerun = [step_sample(job, 1, 1, 0.9, now)] + [coll_sample(job, 1, 1, q, 0.5, now) for q in range(2)]
    for sample in rerun:
        sample["attempt"] = 1
    post(client, rerun, 1)
    assert _count(client, TelemetryDirtyStep) == 1
    client.app.state.telemetry.flush()
    check_stored(client, job, first + rerun)
    with client.app.state.sessions() as s:
        j = s.get(JobStepStat, (job, 1))
    assert j is not None and j.slowest_rank == 1 and j.step_time_max_s == pytest.approx(0.9)


def test_late_samples_make_a_step_dirty_again(client: TestClient) -> None:
    job = _job(client)
    samples = random_run(job, ranks=4, steps=1, calls=3, seed=3)
    early = [s for s in samples if s["rank"] < 3]
    late = [s for s in samples if s["rank"] == 3]
    post(client, early, 0)
    client.app.state.telemetry.flush()
    with client.app.state.sessions() as s:
        assert s.get(JobStepStat, (job, 0)).ranks == 3
    post(client, late, 0, agent="late-agent")  # an agent replaying its spool after an outage
    client.app.state.telemetry.flush()
    with client.app.state.sessions() as s:
        assert s.get(JobStepStat, (job, 0)).ranks == 4
    check_stored(client, job, samples)


def test_retention_prunes_raw_but_keeps_aggregates_and_unaggregated_steps(db_url: str, tmp_path: Path) -> None:
    with make_client(db_url, tmp_path, raw_retention_s=60.0) as client:
        job = _job(client)
        old = random_run(job, ranks=2, steps=3, calls=2, seed=4)
        t_old = time.time() - 3600
        for s in old:
            s["ts"] = t_old + s["step"]
        post(client, old, 0)
        maint = client.app.state.telemetry
        maint.flush()
        recent = [s for s in random_run(job, ranks=2, steps=5, calls=2, seed=5) if s["step"] >= 3]
        post(client, recent, 1)  # steps 3, 4: recent, and not aggregated yet
        raw_before = _count(client, CollectiveMetric) + _count(client, StepMetric)
        report = maint.step(now=time.time(), prune=True)
        assert report.pruned_rows == 3 * 2 * 3  # the 3 old steps: 2 ranks x (1 step + 2 collectives)
        with client.app.state.sessions() as s:
            assert set(s.scalars(select(StepMetric.step).where(StepMetric.job_id == job))) == {3, 4}
        assert _count(client, CollectiveMetric) + _count(client, StepMetric) == raw_before - 18
        # The old steps still read from their aggregates; the new ones from their raw rows.
        steps = client.get(f"{API}/jobs/{job}/steps").json()
        assert [d["step"] for d in steps["data"]] == [[0, 1, 2, 3, 4]] * 2
        assert [d["final"] for d in steps["data"]] == [[True, True, True, False, False]] * 2
        legacy = client.get(f"{API}/jobs/{job}/metrics").json()
        assert [r["step"] for r in legacy["ranks"]] == [[0, 1, 2, 3, 4]] * 2
        raw = client.get(f"{API}/jobs/{job}/collectives", params={"raw": True}).json()
        assert {c["step"] for c in raw["raw"]} == {3, 4}  # raw calls exist only within the window
        # Steps not aggregated yet (dirty) are never pruned, however old.
        assert prune_raw(client.app.state.sessions, now=time.time() + 7200, retention_s=60.0) == 0
        assert _count(client, StepMetric) == 4


# --- REST series --------------------------------------------------------------------------------


def test_steps_endpoint_filters_and_downsampling_keeps_spikes(client: TestClient) -> None:
    job = _job(client)
    now = time.time()
    samples = []
    for st in range(200):
        for r in range(3):
            spike = 5.0 if (st, r) == (137, 2) else 0.1
            samples.append(step_sample(job, r, st, spike, now + st))
            samples.append(coll_sample(job, r, st, 0, 0.01 * (r + 1), now + st))
    post(client, samples, 0)
    client.app.state.telemetry.flush()
    full = client.get(f"{API}/jobs/{job}/steps").json()
    assert full["count"] == 3 and [len(d["step"]) for d in full["data"]] == [200] * 3
    assert full["data"][1]["comm_wait_s"][0] == pytest.approx(0.01)
    assert full["data"][2]["comm_wait_s"][0] == pytest.approx(0.02)
    sub = client.get(f"{API}/jobs/{job}/steps", params={"ranks": [2], "since_step": 100, "until_step": 149}).json()
    assert [d["rank"] for d in sub["data"]] == [2] and sub["data"][0]["step"] == list(range(100, 150))
    by_time = client.get(f"{API}/jobs/{job}/steps", params={"since_ts": now + 10, "until_ts": now + 19.5}).json()
    assert by_time["data"][0]["step"] == list(range(10, 20))
    small = client.get(f"{API}/jobs/{job}/steps", params={"ranks": [2], "max_points": 20}).json()["data"][0]
    assert len(small["step"]) <= 20 and small["step"][0] == 0 and small["step"][-1] == 199
    assert 137 in small["step"] and max(small["step_time_s"]) == 5.0  # the spike survives
    assert client.get(f"{API}/jobs/{job}/steps", params={"max_ranks": 1}).json()["count"] == 3
    assert client.get(f"{API}/jobs/job_nope/steps").status_code == 404
    assert client.get(f"{API}/jobs/{job}/steps", params={"ranks": [-1]}).status_code == 422
    assert client.get(f"{API}/jobs/{job}/steps", params={"max_points": 1}).status_code == 422


def test_collectives_endpoint_aggregates_and_raw_calls(client: TestClient) -> None:
    job = _job(client)
    samples = random_run(job, ranks=4, steps=2, calls=4, seed=7)
    post(client, samples, 0)
    live = client.get(f"{API}/jobs/{job}/collectives").json()  # before aggregation: computed, not final
    assert live["count"] == 2 and all(not f for d in live["data"] for f in d["final"])
    client.app.state.telemetry.flush()
    out = client.get(f"{API}/jobs/{job}/collectives", params={"raw": True, "ranks": [3], "ops": ["all_reduce"]}).json()
    per_kind, _, _ = expected(samples)
    assert [d["op"] for d in out["data"]] == ["all_reduce"] and out["data"][0]["final"] == [True, True]
    assert out["data"][0]["max_s"] == pytest.approx([per_kind[(st, KINDS[0])]["max_s"] for st in (0, 1)])
    raw = out["raw"]
    assert {c["rank"] for c in raw} == {3} and len(raw) == 2 * 2  # 2 steps x the 2 all_reduce calls
    for c in raw:
        fastest = min(s["duration_s"] for s in samples if s["kind"] == "collective" and s["step"] == c["step"]
                      and s["seq"] == c["seq"])
        assert c["wait_s"] == pytest.approx(c["duration_s"] - fastest)
    cut = client.get(f"{API}/jobs/{job}/collectives", params={"raw": True, "raw_limit": 3}).json()
    assert len(cut["raw"]) == 3 and cut["raw_truncated"] is True


# --- bad batches ----------------------------------------------------------------------------------


def test_malformed_and_oversized_batches_store_nothing(client: TestClient) -> None:
    job = _job(client)
    good = random_run(job, ranks=1, steps=1, calls=1)
    bad = [*good, {**good[1], "duration_s": -1.0}]
    r = client.post(f"{API}/telemetry", json={"agent_id": "a", "node_id": "n", "seq": 0, "sent_at": 1.0,
                                              "samples": bad})
    assert r.status_code == 422 and "duration_s" in json.dumps(r.json()["detail"])
    many = [good[0]] * (MAX_TELEMETRY_ITEMS + 1)
    r = client.post(f"{API}/telemetry", json={"agent_id": "a", "node_id": "n", "seq": 1, "sent_at": 1.0,
                                              "samples": many})
    assert r.status_code == 422 and "samples" in json.dumps(r.json()["detail"])
    r = client.post(f"{API}/telemetry", content=gzip.compress(b'{"agent_id": "a", "samples": [' + b" " * (5 << 20)),
                    headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    for model in (StepMetric, CollectiveMetric, TelemetryBatchSeen, TelemetryDirtyStep):
        assert _count(client, model) == 0, model


# --- Prometheus ------------------------------------------------------------------------------------


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_series_and_bounded_labels(db_url: str, tmp_path: Path) -> None:
    with make_client(db_url, tmp_path, metrics_max_ranks=8, metrics_max_jobs=3) as client:
        assert client.get("/metrics", headers={"Authorization": ""}).status_code == 401
        jobs = [_job(client) for _ in range(5)]
        now = time.time()
        hb = {"ts": now - 3.0, "hostname": "h", "host": {"nics": {"available": True, "interfaces": {
            f"eth{i}": {"rx_bytes_per_s": 1000.0 * (i + 1), "tx_bytes_per_s": 10.0, "operstate": "up"}
            for i in range(40)}}}}
        for seq, job in enumerate(jobs):
            samples = []
            for r in range(200):  # many ranks: per-rank series must stay capped
                samples.append(step_sample(job, r, 0, 0.1 + r / 1000, now))
                samples += [coll_sample(job, r, 0, q, 0.01 + r / 10000, now) for q in range(2)]
            post(client, samples, seq, heartbeat=hb)
        client.app.state.telemetry.flush()
        client.post(f"{API}/jobs/{jobs[0]}/cancel")  # an ended job is no longer exported
        fams = _families(client.get("/metrics").text)
        exported = {s.labels["job"] for s in fams["vigil_job_step_time_max_seconds"].samples}
        assert exported == set(jobs[-3:])  # newest three active jobs (max 3)
        per_rank = fams["vigil_rank_step_time_seconds"].samples
        for job in exported:
            ranks = {s.labels["rank"] for s in per_rank if s.labels["job"] == job}
            assert ranks == {str(r) for r in range(192, 200)}  # the 8 slowest of 200
        slowest = [s.value for s in fams["vigil_job_step_time_max_seconds"].samples]
        assert slowest == [pytest.approx(0.1 + 199 / 1000)] * 3
        hist = [s for s in fams["vigil_job_rank_step_time_seconds"].samples if s.name.endswith("_count")]
        assert {s.value for s in hist} == {200.0}
        waits = {s.labels["op"]: s.value for s in fams["vigil_collective_wait_max_seconds"].samples
                 if s.labels["job"] == jobs[-1]}
        assert waits == {"all_reduce": pytest.approx(199 / 10000), "all_gather": pytest.approx(199 / 10000)}
        bits = [s.value for s in fams["vigil_job_wire_bits_per_step"].samples if s.labels["job"] == jobs[-1]]
        assert bits == [8.0 * 200 * (1500 + 1501)]
        rx = fams["vigil_node_nic_receive_bytes_per_second"].samples
        assert len(rx) == 16 and {s.labels["node"] for s in rx} == {"n1"}  # interfaces capped at 16
        assert {s.labels["interface"]: s.value for s in rx}["eth1"] == 2000.0
        age = fams["vigil_node_heartbeat_age_seconds"].samples
        assert len(age) == 1 and 0.0 <= age[0].value < 60  # since the controller heard the agent
        total = sum(len(f.samples) for f in fams.values())
        assert total < 600, total  # 5 jobs x 200 ranks x 40 NICs would be far more
    with make_client(db_url, tmp_path / "open", metrics_open=True) as client:
        assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200


def test_prometheus_exports_infiniband_ports_beside_nics(db_url: str, tmp_path: Path) -> None:
    """An HCA port (``host.infiniband.ports``, the NIC keys) is exported as an interface like ``eth0``."""
    with make_client(db_url, tmp_path) as client:
        job = _job(client)
        now = time.time()
        hb = {"ts": now, "hostname": "h", "host": {
            "nics": {"available": True, "interfaces": {"eth0": {"rx_bytes_per_s": 10.0, "operstate": "up"}}},
            "infiniband": {"available": True, "ports": {
                "mlx5_0/1": {"rx_bytes_per_s": 12.5e9, "tx_bytes_per_s": 11.0e9, "operstate": "up"},
                "mlx5_1/1": {"rx_bytes_per_s": 0.0, "operstate": "down"}}}}}
        post(client, [step_sample(job, 0, 0, 0.1, now)], 0, heartbeat=hb)
        client.app.state.telemetry.flush()
        fams = _families(client.get("/metrics").text)
        rx = {s.labels["interface"]: s.value for s in fams["vigil_node_nic_receive_bytes_per_second"].samples}
        assert rx == {"eth0": 10.0, "mlx5_0/1": 12.5e9, "mlx5_1/1": 0.0}
        up = {s.labels["interface"]: s.value for s in fams["vigil_node_nic_up"].samples}
        assert up == {"eth0": 1.0, "mlx5_0/1": 1.0, "mlx5_1/1": 0.0}


def test_start_up_collectives_are_in_the_breakdown_not_in_the_step_series(client: TestClient) -> None:
    """Step 0 holds only collectives (the start-up broadcast of the weights): /steps shows it, the loss
    and step-time series of /metrics (training steps) do not, before or after aggregation."""
    job = _job(client)
    now = time.time()
    samples = [coll_sample(job, r, 0, 0, 0.02, now) for r in range(2)]
    for st in (1, 2):
        for r in range(2):
            samples += [step_sample(job, r, st, 0.1, now + st), coll_sample(job, r, st, 0, 0.01, now + st)]
    post(client, samples, 0)
    for aggregated in (False, True):
        if aggregated:
            assert client.app.state.telemetry.step(now=time.time() + 10).aggregated_steps == 3
        series = client.get(f"{API}/jobs/{job}/metrics").json()["ranks"]
        assert [(s["rank"], s["step"]) for s in series] == [(0, [1, 2]), (1, [1, 2])], aggregated
        assert all(t == 0.1 for s in series for t in s["step_time_s"])
        steps = client.get(f"{API}/jobs/{job}/steps").json()["data"]
        assert [(d["rank"], d["step"], d["collectives"]) for d in steps] == [(0, [0, 1, 2], [1, 1, 1]),
                                                                             (1, [0, 1, 2], [1, 1, 1])], aggregated
