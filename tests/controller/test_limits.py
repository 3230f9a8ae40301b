"""Hardened input: body size, lengths, numeric ranges and list lengths are refused with 413/422 naming
the field and the limit, with nothing stored; hostile names are stored verbatim and harm nothing.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql cases.
"""

from __future__ import annotations

import ast
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, inspect, select

from controller.models import Event, Job, Node, StepMetric, TelemetryBatchSeen
from tests.controller.fakes import FakeLauncher
from tests.harness import build_app, in_process, settings_for
from vigil.contract.schemas import INT32_MAX, MAX_TELEMETRY_ITEMS, slugify

API = "/api/v1"
LIMIT = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def _client(db_url: str, home: Path, **settings: Any) -> Iterator[TestClient]:
    with in_process(build_app(settings_for(home, db_url, **settings))) as c:
        yield c


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    """The default body limit (8 MiB): large enough for a batch one sample over the list limit."""
    yield from _client(db_url, tmp_path / "home")


@pytest.fixture
def small(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    yield from _client(db_url, tmp_path / "home", max_body_bytes=LIMIT)


def _count(client: TestClient, model: type) -> int:
    with client.app.state.sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def _nothing_stored(client: TestClient) -> None:
    for model in (Job, Event, StepMetric, TelemetryBatchSeen, Node):
        assert _count(client, model) == 0, model.__name__


# --- body size ------------------------------------------------------------------------------------


def test_declared_oversized_body_is_413_naming_the_limit(small: TestClient) -> None:
    body = json.dumps({"name": "x" * (LIMIT + 1)})
    for path in ("/jobs", "/telemetry", "/tokens"):
        r = small.post(API + path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and str(LIMIT) in r.json()["detail"], path
    _nothing_stored(small)


def test_streamed_oversized_body_is_413(small: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"name": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    for path in ("/jobs", "/telemetry"):
        r = small.post(API + path, content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.text)
        assert str(LIMIT) in r.json()["detail"]
    _nothing_stored(small)


def test_bad_content_length_is_400(client: TestClient) -> None:
    r = client.post(f"{API}/jobs", content=b"{}", headers={"Content-Length": "lots", "Content-Type": "application/json"})
    assert r.status_code == 400
    _nothing_stored(client)


# --- job spec ranges and lengths ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "limit"),
    [
        ({"scaling": {"min_workers": 0}}, "min_workers", "greater than or equal to 1"),
        ({"scaling": {"max_workers": 1025}}, "max_workers", "less than or equal to 1024"),
        ({"scaling": {"cpus_per_worker": 0}}, "cpus_per_worker", "greater than 0"),
        ({"steps": 0}, "steps", "greater than or equal to 1"),
        ({"steps": 10_000_001}, "steps", "less than or equal to 10000000"),
        ({"batch_size": 0}, "batch_size", "greater than or equal to 1"),
        ({"batch_size": 65_537}, "batch_size", "less than or equal to 65536"),
        ({"optimizer": {"lr": 0}}, "lr", "greater than 0"),
        ({"optimizer": {"lr": 10.5}}, "lr", "less than or equal to 10"),
        ({"optimizer": {"params": {f"p{i}": i for i in range(65)}}}, "params", "at most 64"),
        ({"optimizer": {"params": {"k" * 65: 1}}}, "params", "at most 64 characters"),
        ({"optimizer": {"params": {"k": "v" * 257}}}, "params", "at most 256 characters"),
        ({"model": {"n_layer": 49}}, "n_layer", "less than or equal to 48"),
        ({"name": "n" * 129}, "name", "at most 128 characters"),
        ({"name": "two\nlines"}, "name", "control characters"),
        ({"name": "nul\x00byte"}, "name", "control characters"),
    ],
)
def test_out_of_range_job_spec_is_422_and_stores_nothing(client: TestClient, spec: dict, field: str,
                                                         limit: str) -> None:
    r = client.post(f"{API}/jobs", json={"name": "j", **spec})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and limit in d["msg"] for d in detail), detail
    _nothing_stored(client)


def test_non_finite_values_are_422_not_echoed(client: TestClient) -> None:
    """A NaN in a refused body must not make the answer itself unwritable (JSON has no NaN)."""
    for path, body in (("/jobs", '{"name": "j", "optimizer": {"params": {"tau": NaN}}}'),
                       ("/jobs", '{"name": "j", "optimizer": {"lr": Infinity}}'),
                       ("/jobs", '{"name": NaN}'),
                       ("/tokens", '{"role": "user", "name": NaN}')):
        r = client.post(API + path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (path, body, r.text)
        assert all(set(d) == {"type", "loc", "msg"} for d in r.json()["detail"])  # no input echoed back
    _nothing_stored(client)


# --- telemetry lists, ranges, and text --------------------------------------------------------------


def _step(job_id: str, **kw: Any) -> dict:
    return {"kind": "step", "job_id": job_id, "rank": 0, "step": 0, "ts": time.time(), "loss": 1.0,
            "step_time_s": 0.1, **kw}


def _batch(job_id: str, samples: list[dict] | None = None, heartbeat: dict | None = None, **kw: Any) -> dict:
    return {"agent_id": "a1", "node_id": "n1", "seq": 0, "sent_at": time.time(),
            "samples": samples if samples is not None else [_step(job_id)], "heartbeat": heartbeat, **kw}


def _deep(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"x": d}
    return d


@pytest.mark.parametrize(
    ("make", "field", "limit"),
    [
        (lambda j: _batch(j, samples=[_step(j)] * (MAX_TELEMETRY_ITEMS + 1)), "samples", f"at most {MAX_TELEMETRY_ITEMS}"),
        (lambda j: _batch(j, heartbeat={"ts": 1.0, "ranks": [{"job_id": j, "rank": 0, "pid": 1}] * 4097}), "ranks",
         "at most 4096"),
        (lambda j: _batch(j, samples=[_step(j, step=INT32_MAX + 1)]), "step", f"less than or equal to {INT32_MAX}"),
        (lambda j: _batch(j, samples=[_step(j, ts=1e300)]), "ts", "less than or equal to"),
        (lambda j: _batch(j, heartbeat={"ts": 1e300}), "ts", "less than or equal to"),
        (lambda j: _batch(j, heartbeat={"ts": 1.0, "host": _deep(20)}), "host", "deeper than 12"),
        (lambda j: _batch(j, node_id="n" * 129), "node_id", "at most 128 characters"),
        (lambda j: _batch(j, node_id="bad\x00node"), "node_id", "control characters"),
        (lambda j: _batch(j, seq=2**63), "seq", "less than or equal to"),
    ],
)
def test_bad_telemetry_is_422_naming_field_and_limit(client: TestClient, make, field: str,  # type: ignore[no-untyped-def]
                                                     limit: str) -> None:
    r = client.post(f"{API}/telemetry", content=json.dumps(make("job_x")), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in map(str, d["loc"]) and limit in d["msg"] for d in detail), detail
    _nothing_stored(client)


def test_non_finite_host_metrics_are_stored_as_null(client: TestClient) -> None:
    body = json.dumps(_batch("job_x", samples=[], heartbeat={"ts": time.time(), "host": {"cpu": float("nan")}}))
    assert client.post(f"{API}/telemetry", content=body, headers={"Content-Type": "application/json"}).status_code == 200
    assert client.get(f"{API}/nodes").json()["data"][0]["host"] == {"cpu": None}


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/jobs", {"offset": 10**9 + 1}),
        ("/jobs", {"limit": 1001}),
        ("/events", {"job_id": "../../etc"}),
        ("/events", {"job_id": "x" * 65}),
        ("/jobs/job_x/metrics", {"since_step": INT32_MAX + 1}),
        ("/jobs/job%00x", {}),
        ("/jobs/..%2F..%2Fetc", {}),
        ("/tokens/tok%00/revoke", {}),
    ],
)
def test_out_of_range_queries_and_ids_are_refused_cleanly(client: TestClient, path: str, params: dict) -> None:
    method = "POST" if path.endswith("/revoke") else "GET"
    r = client.request(method, API + path, params=params)
    assert r.status_code in (404, 422), (path, r.status_code, r.text)


# --- hostile names: stored verbatim, harmless -------------------------------------------------------

HOSTILE = ["../../etc", "'; DROP TABLE jobs; --", "Robert'); DROP TABLE jobs;--", "$(touch /tmp/pwned)",
           "`id`", "<script>alert(1)</script>", "/abs/path", "..", "名前 ✓ ünïcode", "%s%s%n"]


def test_hostile_names_are_stored_verbatim_and_harm_nothing(client: TestClient, tmp_path: Path) -> None:
    before = {p: sorted(os.listdir(p)) for p in (tmp_path.parent, Path("/tmp"), ROOT)}
    ids = {}
    for name in HOSTILE:
        r = client.post(f"{API}/jobs", json={"name": name, "steps": 5})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == name
        ids[name] = r.json()["id"]
    client.app.state.supervisor.step()  # launched: the spec reaches the (fake) engine as data
    launcher: FakeLauncher = client.app.state.launcher
    assert sorted(spec.name for _id, spec, _env in launcher.submitted) == sorted(HOSTILE)
    for name, job_id in ids.items():
        assert client.get(f"{API}/jobs/{job_id}").json()["name"] == name
    listed = {j["id"]: j["name"] for j in client.get(f"{API}/jobs").json()["data"]}
    assert listed == {v: k for k, v in ids.items()}
    with client.app.state.sessions() as s:
        assert sorted(s.scalars(select(Job.name)).all()) == sorted(HOSTILE)
    assert "jobs" in inspect(client.app.state.engine).get_table_names()
    after = {p: sorted(os.listdir(p)) for p in before}
    assert after[tmp_path.parent] == before[tmp_path.parent] and after[ROOT] == before[ROOT]
    assert "pwned" not in after[Path("/tmp")]


@pytest.mark.parametrize("name", [*HOSTILE, "", ".", "...", "-", "a" * 500, "job_0123abcd"])
def test_slugify_gives_one_safe_path_component(name: str, tmp_path: Path) -> None:
    slug = slugify(name)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", slug), slug
    assert ".." not in slug
    assert (tmp_path / f"vigil-{slug}").resolve().parent == tmp_path.resolve()
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name) and len(name) <= 64:
        assert slug == name  # a safe name (a job id) keeps naming the same folder
    assert slugify(name) == slug and (name == "a" or slugify(name + "a") != slug)  # stable, and distinct


# SQL text built with f-strings that was read and found safe: what it interpolates are names from
# the code, never input, and every value is a bound parameter. A new one must be added here on purpose.
REVIEWED_SQL_TEXT = {
    "controller/telemetry.py::bulk_insert": "table and column names are the module's constants; rows are bound",
    "controller/telemetry.py::mark_dirty": "interpolates only the driver's placeholder (? or %s); values bound",
    "controller/telemetry.py::update_job_progress": "interpolates only the driver's placeholder; values bound",
    "ops/bench/ingest_db.py::_database": "a database name the benchmark generates (vigil_bench_<hex>)",
}
SQL_CALLS = {"text", "exec_driver_sql", "execute", "executemany", "copy"}


def _built_string(node: ast.expr) -> bool:
    """An f-string, a concatenation or %-format, or a ``.format()`` call."""
    return isinstance(node, ast.JoinedStr | ast.BinOp) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format")


def test_no_sql_is_built_from_strings() -> None:
    """Queries are SQLAlchemy expressions with bound parameters: no built string reaches SQL text."""
    offenders = []
    for path in [*(ROOT / "controller").rglob("*.py"), *(ROOT / "ops").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if callee in SQL_CALLS and _built_string(node.args[0]) and f"{rel}::{fn.name}" not in REVIEWED_SQL_TEXT:
                    offenders.append(f"{rel}:{node.lineno} in {fn.name}()")
    assert offenders == [], "SQL text built from strings (bind the values; review and list it if it is names only)"
