"""The columnar ingest endpoint (``POST /api/v1/telemetry/columnar``, :mod:`controller.columnar`):
it stores exactly what the JSON endpoint stores for the same samples, refuses every rule of the
schema with a 422 naming the field and stores nothing then, and keeps exactly-once under replayed,
reordered and renumbered batches (mixed with JSON ones too). A fuzz test checks that the
column-wise validation accepts a batch exactly when pydantic accepts each of its samples.

Runs the real app over TestClient on SQLite and PostgreSQL (``db_url``).
Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, select

from agent.columnar import encode_blocks
from controller.columnar import ColumnarError, decode
from controller.models import (
    Checkpoint,
    CollectiveMetric,
    Fault,
    Job,
    Node,
    StepMetric,
    TelemetryBatchSeen,
    TelemetryDirtyStep,
)
from controller.telemetry import STEP_COLUMNS, STEP_NOT_STORED, newest_step_lowest_rank
from tests.controller.samples import coll_sample, step_sample
from tests.controller.telemetry_client import columnar, make_client, post_columnar
from tests.live_controller import checkpoint_path
from vigil.contract.schemas import CollectiveSample, StepSample
from vigil.contract.schemas.columnar import ColumnBlock, column_specs

API = "/api/v1"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


def _job(client: TestClient) -> str:
    r = client.post(f"{API}/jobs", json={"name": "columnar", "steps": 100})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def as_json(client: TestClient, samples: list[dict[str, Any]], seq: int, agent: str = "agent-j",
            node: str = "node-a", heartbeat: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"agent_id": agent, "node_id": node, "seq": seq, "sent_at": time.time(), "samples": samples}
    if heartbeat:
        body["heartbeat"] = heartbeat
    r = client.post(f"{API}/telemetry", content=gzip.compress(json.dumps(body).encode()),
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def _counts(client: TestClient) -> tuple[int, int, int]:
    with client.app.state.sessions() as s:
        return (s.scalar(select(func.count()).select_from(StepMetric)) or 0,
                s.scalar(select(func.count()).select_from(CollectiveMetric)) or 0,
                s.scalar(select(func.count()).select_from(TelemetryBatchSeen)) or 0)


def _stored(client: TestClient, job: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every stored column but the id and the job, in a canonical order."""
    def cols(model: Any) -> list[Any]:
        return [c for c in model.__table__.columns if c.name not in ("id", "job_id")]

    with client.app.state.sessions() as s:
        steps = sorted(tuple(r) for r in s.execute(select(*cols(StepMetric)).where(StepMetric.job_id == job)))
        colls = sorted(tuple(r) for r in s.execute(select(*cols(CollectiveMetric))
                                                   .where(CollectiveMetric.job_id == job)))
    return steps, colls


def _mixed(job: str, steps: range, ranks: int = 3, calls: int = 2) -> list[dict[str, Any]]:
    now = 1_700_000_000.0
    out: list[dict[str, Any]] = []
    for step in steps:
        for rank in range(ranks):
            s = step_sample(job, rank, step, 0.1 + 0.01 * rank, now + step, comm=None if rank == 1 else 0.02)
            s |= {"attempt": 1, "lr": None if rank == 2 else 1e-3, "pid": 100 + rank, "dropped": rank}
            if rank == 0 and step == steps[0]:
                s["loss"] = None  # not finite on the rank: a finding, stored as NULL
            out.append(s)
            out += [{**coll_sample(job, rank, step, q, 0.01 * (q + 1), now + step), "attempt": 1} for q in range(calls)]
    return out


# --------------------------------------------------------------------------------------------------
# The same rows as the JSON endpoint
# --------------------------------------------------------------------------------------------------


def test_a_columnar_batch_stores_what_the_json_batch_stores(client: TestClient) -> None:
    j_job, c_job = _job(client), _job(client)
    heartbeat = {"ts": time.time(), "hostname": "h", "ranks": [{"job_id": j_job, "rank": 0, "pid": 100}],
                 "host": {"cpu": 0.5}}
    def extras(job: str) -> list[dict[str, Any]]:
        return [
            {"kind": "checkpoint", "job_id": job, "step": 3, "ts": time.time(), "path": checkpoint_path(client.app, job, 3),
             "files": 2, "bytes": 10},
            {"kind": "step", "job_id": "no-such-job", "rank": 0, "step": 1, "ts": 1.0, "loss": 1.0, "step_time_s": 0.1},
        ]
    j_ack = as_json(client, _mixed(j_job, range(1, 5)) + extras(j_job), 0, heartbeat=heartbeat)
    c_ack = columnar(client, _mixed(c_job, range(1, 5)) + extras(c_job), 0, heartbeat=heartbeat)
    assert c_ack == j_ack == {"accepted": True, "duplicate": False, "stored": 4 * 3 * 3 + 1}
    assert _stored(client, c_job) == _stored(client, j_job)
    with client.app.state.sessions() as s:
        jobs = {j.id: (j.last_step, j.last_loss) for j in s.scalars(select(Job))}
        assert jobs[c_job] == jobs[j_job] == (4, 2.0)
        dirty = sorted(s.execute(select(TelemetryDirtyStep.job_id, TelemetryDirtyStep.step)).all())
        assert [st for j, st in dirty if j == c_job] == [st for j, st in dirty if j == j_job] == [1, 2, 3, 4]
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == c_job)) == 1
        node = s.get(Node, "node-a")
        assert node is not None and node.hostname == "h" and node.last_heartbeat is not None


def test_the_step_record_is_declared_once() -> None:
    """``step_metrics`` holds exactly the sample's stored fields (STEP_COLUMNS, derived from StepSample), plus
    its own id and the batch's node; the fields left out are named, not forgotten."""
    assert set(STEP_COLUMNS) | STEP_NOT_STORED == set(StepSample.model_fields)
    # The table in the sample's order.
    assert [c.name for c in StepMetric.__table__.columns if c.name not in ("id", "node_id")] == list(STEP_COLUMNS)
    assert set(column_specs("step")) >= set(STEP_COLUMNS)  # every stored field travels as a column


def test_the_newest_step_lowest_rank_is_chosen_once_for_both_formats() -> None:
    job = np.array(["b", "a", "a", "b", "a"])
    assert newest_step_lowest_rank(job, np.array([3, 5, 5, 3, 4]), np.array([1, 2, 0, 0, 9])) == [2, 3]
    assert newest_step_lowest_rank(np.array([], dtype=np.uint32), np.array([]), np.array([])) == []


def test_nan_loss_is_stored_as_null_and_defaults_fill_left_out_columns(client: TestClient) -> None:
    job = _job(client)
    n = 3
    step = ColumnBlock(n=n, columns={
        "job_id": np.zeros(n, "<u4").tobytes(), "rank": np.arange(n, dtype="<i8").tobytes(),
        "step": np.ones(n, "<i8").tobytes(), "ts": np.full(n, 1e9, "<f8").tobytes(),
        "loss": np.array([np.nan, np.inf, 2.5], "<f8").tobytes(), "step_time_s": np.full(n, 0.1, "<f8").tobytes(),
        "data_s": np.array([0.0, 0.1, 0.2], "<f8").tobytes()},
        nulls={"data_s": np.array([1, 0, 0], "u1").tobytes()})
    r = post_columnar(client, encode_blocks(_header(), [job], step, None))
    assert r.status_code == 200 and r.json()["stored"] == 3, r.text
    with client.app.state.sessions() as s:
        got = s.execute(select(StepMetric.rank, StepMetric.loss, StepMetric.data_s, StepMetric.attempt,
                               StepMetric.tokens, StepMetric.lr).order_by(StepMetric.rank)).all()
    assert [tuple(g) for g in got] == [(0, None, None, 0, 0, None), (1, None, 0.1, 0, 0, None),
                                       (2, 2.5, 0.2, 0, 0, None)]


def test_the_json_path_stores_a_non_finite_loss_as_null_too(client: TestClient) -> None:
    """JSON carries NaN and Infinity (Python's json writes them; a hand-written client may): the loss, lr and
    val_loss are stored as null as the columnar path stores them (it stored NaN as NaN on PostgreSQL)."""
    job = _job(client)
    samples = [{"kind": "step", "job_id": job, "rank": r, "step": 1, "ts": 1e9, "loss": loss, "lr": lr,
                "val_loss": val, "step_time_s": 0.1}
               for r, (loss, lr, val) in enumerate([(math.nan, math.inf, -math.inf), (2.5, 0.1, 3.0)])]
    assert as_json(client, samples, 0)["stored"] == 2
    with client.app.state.sessions() as s:
        got = s.execute(select(StepMetric.rank, StepMetric.loss, StepMetric.lr, StepMetric.val_loss)
                        .order_by(StepMetric.rank)).all()
    assert [tuple(g) for g in got] == [(0, None, None, None), (1, 2.5, 0.1, 3.0)]


# --------------------------------------------------------------------------------------------------
# Every documented rule refused, the field named, nothing stored
# --------------------------------------------------------------------------------------------------


def _header(seq: int = 0, node: str = "node-a", samples: list[Any] | None = None) -> bytes:
    return json.dumps({"agent_id": "agent-a", "node_id": node, "seq": seq, "sent_at": time.time(),
                       "samples": samples or []}).encode()


def _good_block(kind: str, n: int = 4) -> ColumnBlock:
    """A valid block of ``n`` rows of ``kind``, every column present; the job is string 0."""
    cols: dict[str, bytes] = {}
    for name, spec in column_specs(kind).items():
        if spec.type == "str":
            cols[name] = np.zeros(n, "<u4").tobytes() if name == "job_id" else np.ones(n, "<u4").tobytes()
        elif name in ("rank", "seq"):
            cols[name] = np.arange(n, dtype="<i8").tobytes()
        elif spec.type == "int":
            cols[name] = np.full(n, max(1, spec.ge or 0), spec.dtype).tobytes()
        else:
            cols[name] = np.full(n, 1.0 if name != "ts" else 1.7e9, spec.dtype).tobytes()
    return ColumnBlock(n=n, columns=cols)


def _cases() -> list[tuple[str, str, str, Any]]:
    """(kind, field, what, bad value) for every rule the schema documents."""
    out = []
    for kind in ("step", "collective"):
        for name, spec in column_specs(kind).items():
            if spec.type == "str":
                out += [(kind, name, "too long", "x" * 65), (kind, name, "control character", "a\nb")]
                if any(getattr(m, "min_length", 0) for m in spec.metadata):
                    out.append((kind, name, "empty", ""))
                continue
            if spec.ge is not None:
                out.append((kind, name, "below ge", spec.ge - (1 if spec.type == "int" else 1e-3)))
            if spec.le is not None and spec.le < 2**63 - 1:
                out.append((kind, name, "above le", spec.le + 1))
            if spec.finite:
                out += [(kind, name, "nan", math.nan), (kind, name, "inf", math.inf)]
    return out


@pytest.mark.parametrize(("kind", "name", "what", "bad"), _cases(), ids=lambda v: str(v)[:12])
def test_each_rule_is_refused_naming_the_field_and_nothing_is_stored(
        client: TestClient, kind: str, name: str, what: str, bad: Any) -> None:
    job = _job(client)
    spec = column_specs(kind)[name]
    blk = _good_block(kind)
    strings = [job, "ok"]
    if spec.type == "str":
        strings.append(bad)
        idx = np.frombuffer(blk.columns[name], "<u4").copy()
        idx[2] = 2
        blk.columns[name] = idx.tobytes()
    else:
        arr = np.frombuffer(blk.columns[name], spec.dtype).copy()
        arr[2] = bad
        blk.columns[name] = arr.tobytes()
    body = encode_blocks(_header(), strings, blk if kind == "step" else None, blk if kind == "collective" else None)
    r = post_columnar(client, body)
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == ["samples", kind, name], err
    assert "row 2" in err["msg"]
    assert _counts(client) == (0, 0, 0)
    # The JSON endpoint refuses the same value of the same field.
    model = StepSample if kind == "step" else CollectiveSample
    with pytest.raises(ValidationError) as exc:
        model.model_validate({**_row(kind, blk, strings, 0), name: bad})
    assert exc.value.errors()[0]["loc"][0] == name


@pytest.mark.parametrize("what", ["missing", "extra", "short", "nulls", "index", "too many", "header", "garbage",
                                  "header step"])
def test_malformed_batches_are_refused_whole(client: TestClient, what: str) -> None:
    job = _job(client)
    blk = _good_block("collective")
    strings = [job, "ok"]
    header = _header()
    loc: list[Any] = ["samples", "collective"]
    if what == "missing":
        del blk.columns["duration_s"]
        loc.append("duration_s")
    elif what == "extra":
        blk.columns["colour"] = b"\0" * 32
        loc.append("colour")
    elif what == "short":
        blk.columns["wire_bytes"] = blk.columns["wire_bytes"][:-8]
        loc.append("wire_bytes")
    elif what == "nulls":
        blk.nulls["duration_s"] = bytes(4)
        loc.append("duration_s")
    elif what == "index":
        blk.columns["op"] = np.array([1, 1, 7, 1], "<u4").tobytes()
        loc.append("op")
    elif what == "too many":
        blk = ColumnBlock(n=10_001, columns=blk.columns)
        loc = ["samples", "collective"]
    elif what == "header":
        header = json.dumps({"agent_id": "", "node_id": "node-a", "seq": 0, "sent_at": 1.0}).encode()
        loc = ["agent_id"]
    elif what == "header step":
        header = _header(samples=[step_sample(job, 0, 1, 0.1, 1.0)])
        loc = ["samples", 0, "step"]
    body = encode_blocks(header, strings, None, blk) if what != "garbage" else b"\xc1not msgpack"
    r = post_columnar(client, body)
    assert r.status_code == 422, r.text
    if what != "garbage":
        assert r.json()["detail"][0]["loc"] == loc, r.text
    assert _counts(client) == (0, 0, 0)


def test_a_columnar_body_under_another_content_type_is_refused(client: TestClient) -> None:
    r = client.post(f"{API}/telemetry/columnar", content=encode_blocks(_header(), [], None, None),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 415


# --------------------------------------------------------------------------------------------------
# Exactly once
# --------------------------------------------------------------------------------------------------


def test_replayed_reordered_and_renumbered_columnar_batches_store_each_sample_once(client: TestClient) -> None:
    job = _job(client)
    samples = _mixed(job, range(1, 6))  # 15 step samples, 30 collective samples
    assert columnar(client, samples, 0)["stored"] == 45
    assert columnar(client, samples, 0) == {"accepted": True, "duplicate": True, "stored": 0}
    assert columnar(client, samples, 7)["stored"] == 0  # renumbered
    shuffled = random.Random(3).sample(samples, len(samples))
    acks = [columnar(client, shuffled[i:i + 10], 100 + i, agent="agent-b") for i in range(0, len(shuffled), 10)]
    assert sum(a["stored"] for a in acks) == 0 and not any(a["duplicate"] for a in acks)
    assert as_json(client, shuffled, 1)["stored"] == 0  # the same samples through the JSON endpoint
    extra = _mixed(job, range(6, 7), ranks=1, calls=1)
    assert columnar(client, [samples[0], *extra, *extra], 200)["stored"] == 2  # twice in one batch: once
    # New samples first through JSON, then replayed in columns: still once.
    more = _mixed(job, range(7, 9))
    assert as_json(client, more[::-1], 2)["stored"] == len(more)
    assert columnar(client, more, 300)["stored"] == 0
    steps, colls = _stored(client, job)
    assert (len(steps), len(colls)) == (15 + 1 + 6, 30 + 1 + 12)
    with client.app.state.sessions() as s:
        stored = dict(s.execute(select(TelemetryBatchSeen.seq, TelemetryBatchSeen.samples)
                                .where(TelemetryBatchSeen.agent_id == "agent-a")).all())
    assert stored == {0: 45, 7: 0, 200: 2, 300: 0}


def test_a_columnar_fault_report_sets_the_hit_step_once(client: TestClient) -> None:
    job = _job(client)
    r = client.post(f"{API}/jobs/{job}/faults", json={"kind": "hang_rank", "step": 5, "rank": 0})
    assert r.status_code in (200, 201), r.text
    fid = r.json()["id"]
    report = {"kind": "fault", "job_id": job, "rank": 0, "step": 6, "ts": time.time(), "fault_id": fid,
              "fault_kind": "hang_rank"}
    assert columnar(client, [report], 0)["stored"] == 1
    assert columnar(client, [{**report, "step": 9}], 1)["stored"] == 1
    with client.app.state.sessions() as s:
        assert s.get(Fault, fid).hit_step == 6  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------------
# Fuzz: column-wise validation agrees with pydantic, and a refused batch stores nothing
# --------------------------------------------------------------------------------------------------


def _row(kind: str, blk: ColumnBlock, strings: list[str], i: int) -> dict[str, Any]:
    """Row ``i`` of ``blk`` as the JSON sample a client would send."""
    out: dict[str, Any] = {"kind": kind}
    for name, spec in column_specs(kind).items():
        if name not in blk.columns:
            continue
        if name in blk.nulls and blk.nulls[name][i]:
            out[name] = None
            continue
        v = np.frombuffer(blk.columns[name], spec.dtype)[i].item()
        if spec.type == "str":
            v = strings[v] if v < len(strings) else None
        elif spec.type == "float" and not spec.finite and not math.isfinite(v):
            v = None  # "None when not finite": what a JSON client sends for it
        out[name] = v
    return out


_WILD = {"int": [-1, 0, 1, 999_999, 1_000_000, 1_000_001, 2**31 - 1, 2**31, 2**62],
         "float": [-1e-9, 0.0, 0.5, 1.7e9, 2.6e11, math.nan, math.inf, -math.inf]}


def test_fuzz_columnar_validation_agrees_with_the_schema(client: TestClient) -> None:
    rng = random.Random(16)
    job = _job(client)
    strings = [job, "all_reduce", "", "x" * 64, "x" * 65, "tab\there", "world"]
    accepted = refused = 0
    for trial in range(150):
        kind = rng.choice(["step", "collective"])
        blk = _good_block(kind, n=rng.randint(1, 6))
        n = blk.n
        for name in rng.sample(list(blk.columns), rng.randint(1, 3)):
            spec = column_specs(kind)[name]
            if spec.type == "str":
                blk.columns[name] = np.array([rng.randrange(len(strings)) for _ in range(n)], "<u4").tobytes()
            else:
                blk.columns[name] = np.array([rng.choice(_WILD[spec.type]) for _ in range(n)], spec.dtype).tobytes()
            if spec.nullable and rng.random() < 0.3:
                blk.nulls[name] = np.array([rng.random() < 0.5 for _ in range(n)], "u1").tobytes()
        rows = [_row(kind, blk, strings, i) for i in range(n)]
        model = StepSample if kind == "step" else CollectiveSample
        try:
            for row in rows:
                model.model_validate(row)
            schema_ok = True
        except ValidationError:
            schema_ok = False
        body = encode_blocks(_header(seq=trial), strings, blk if kind == "step" else None,
                             blk if kind == "collective" else None)
        try:
            decode(body)
            ok = True
        except ColumnarError:
            ok = False
        assert ok == schema_ok, (kind, rows)
        if not ok and trial % 5 == 0:  # over HTTP too: refused whole, nothing stored
            before = _counts(client)
            assert post_columnar(client, body).status_code == 422
            assert _counts(client) == before
        accepted += ok
        refused += not ok
    assert accepted > 10 and refused > 10


def test_the_ingest_benchmark_sends_the_same_samples_in_both_formats() -> None:
    """``vigil bench ingest --format columnar`` measures the same load as ``--format json``."""
    from agent.columnar import to_batch
    from ops.bench.ingest import build_bodies, build_columnar_bodies
    from vigil.contract.schemas import TelemetryBatch

    def key(s: Any) -> tuple[Any, ...]:
        return (s.kind, s.rank, s.step, getattr(s, "seq", -1))

    args = ("job-1", 10, 3, 203, 3, 17)
    as_json_ = [TelemetryBatch.model_validate_json(gzip.decompress(b)) for b in build_bodies(*args)]
    as_cols = [to_batch(gzip.decompress(b)) for b in build_columnar_bodies(*args)]
    assert sorted((b.agent_id, b.seq, len(b.samples)) for b in as_cols) == \
        sorted((b.agent_id, b.seq, len(b.samples)) for b in as_json_)
    j = sorted(key(s) for b in as_json_ for s in b.samples)
    c = sorted(key(s) for b in as_cols for s in b.samples)
    assert j == c and len(j) >= 203
