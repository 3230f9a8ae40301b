"""The real app in process and its ingest driven as agents drive it, for the controller tests.

* :func:`make_client`: ``create_app`` (no background loops) on a database URL, as a TestClient holding
  an admin token; ``**settings`` override :class:`vigil.contract.settings.Settings`;
* :func:`create_job`: a job of 100 steps, its id;
* telemetry batches: :func:`post` (gzipped JSON, optionally with a heartbeat), :func:`post_json` (plain
  JSON), :func:`columnar` (the columnar format, encoded by the agent's own encoder) and
  :func:`post_columnar` (a raw columnar body); each but ``post_columnar`` asserts a 200 and returns the ack.

Needs: a database URL (the ``db_url`` fixture: SQLite, or PostgreSQL on 127.0.0.1:5432) and a folder
for the controller's home (``tmp_path``).
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from agent.columnar import encode
from tests.auth import bearer, issue_token
from tests.harness import build_app, settings_for
from vigil.contract.schemas import RankSample
from vigil.contract.schemas.columnar import CONTENT_TYPE

API = "/api/v1"
_SAMPLES: TypeAdapter[list[Any]] = TypeAdapter(list[RankSample])


def make_client(db_url: str, tmp_path: Path, **settings: Any) -> TestClient:
    s = settings_for(tmp_path, db_url, max_body_bytes=4 << 20, aggregate_settle_s=2.0, **settings)
    app = build_app(s, launcher=None)
    return TestClient(app, headers=bearer(issue_token(app, "admin")))


def create_job(client: TestClient) -> str:
    r = client.post(f"{API}/jobs", json={"name": "once", "steps": 100})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def post(client: TestClient, samples: list[dict], seq: int, agent: str = "a1", node: str = "n1",
         heartbeat: dict | None = None) -> dict:
    body = {"agent_id": agent, "node_id": node, "seq": seq, "sent_at": time.time(), "samples": samples}
    if heartbeat is not None:
        body["heartbeat"] = heartbeat
    r = client.post(f"{API}/telemetry", content=gzip.compress(json.dumps(body).encode()),
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def post_json(client: TestClient, samples: list[dict[str, Any]], seq: int, agent: str = "agent-a") -> dict[str, Any]:
    r = client.post(f"{API}/telemetry", json={"agent_id": agent, "node_id": "node-a", "seq": seq,
                                              "sent_at": time.time(), "samples": samples})
    assert r.status_code == 200, r.text
    return r.json()


def post_columnar(client: TestClient, body: bytes, gz: bool = True) -> Any:
    headers = {"Content-Type": CONTENT_TYPE}
    if gz:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    return client.post(f"{API}/telemetry/columnar", content=body, headers=headers)


def columnar(client: TestClient, samples: list[dict[str, Any]], seq: int, agent: str = "agent-a",
             node: str = "node-a", heartbeat: dict[str, Any] | None = None) -> dict[str, Any]:
    from vigil.contract.schemas import Heartbeat

    hb = Heartbeat.model_validate(heartbeat) if heartbeat else None
    r = post_columnar(client, encode(agent, node, seq, time.time(), _SAMPLES.validate_python(samples), hb))
    assert r.status_code == 200, r.text
    return r.json()
