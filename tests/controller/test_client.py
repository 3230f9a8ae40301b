"""vigil.contract.client: the typed methods of the recovery routes (faults, incidents, checkpoints, stacks,
manual recovery, eviction) against a live controller over real HTTP; each answers its wire model.

Needs: uvicorn on 127.0.0.1 (a port the OS picks), SQLite in tmp_path. No Ray: the launcher is a
fake, and the commands queued for agents are only read back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.auth import issue_token
from tests.harness import build_app, serve, settings_for
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import (
    FaultCreate,
    FaultKind,
    FaultStatus,
    IncidentKind,
    JobCreate,
    JobStatus,
    NodeState,
    RecoverRequest,
)

NODE = "vigil-node-1"


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[VigilClient, str]]:
    """An admin client and a RUNNING job whose rank 1 an agent on NODE reported."""
    apps: list[Any] = []

    def make(url: str) -> Any:
        apps.append(build_app(settings_for(tmp_path, controller_url=url)))
        return apps[-1]

    server = serve(make)
    app = apps[0]
    try:
        with VigilClient(server.url, token=issue_token(app, "admin")) as client:
            job_id = client.submit_job(JobCreate(name="j", steps=50)).id
            app.state.supervisor.step()  # launched (fake)
            with app.state.sessions() as s:  # the engine says it runs
                from controller.jobs import get_job, transition

                transition(s, get_job(s, job_id), JobStatus.RUNNING)
                s.commit()
            hb = {"agent_id": "a", "node_id": NODE, "seq": 1, "sent_at": 1.0, "samples": [],
                  "heartbeat": {"ts": 1.0, "ranks": [{"job_id": job_id, "rank": 1, "pid": 4242}]}}
            client.post_telemetry_raw(json.dumps(hb).encode())
            yield client, job_id
    finally:
        server.stop()


def test_faults(running: tuple[VigilClient, str]) -> None:
    client, job_id = running
    f = client.inject_fault(job_id, FaultCreate(kind=FaultKind.SLOW_RANK, rank=1, params={"factor": 2.5}))
    assert (f.job_id, f.kind, f.status, f.rank, f.params) == (job_id, FaultKind.SLOW_RANK, FaultStatus.PENDING, 1,
                                                               {"factor": 2.5})
    listed = client.list_faults(job_id)
    assert listed.count == 1 and listed.data[0].id == f.id
    cleared = client.clear_fault(job_id, f.id)
    assert cleared.id == f.id and cleared.status is FaultStatus.CLEARED
    with pytest.raises(ApiError) as again:
        client.clear_fault(job_id, f.id)
    assert again.value.status_code == 409
    with pytest.raises(ApiError) as unknown:
        client.list_faults("job_unknown")
    assert unknown.value.status_code == 404


def test_recover_and_incidents(running: tuple[VigilClient, str]) -> None:
    client, job_id = running
    inc = client.recover_job(job_id, RecoverRequest(reason="operator says so"))
    assert inc.job_id == job_id and inc.kind is IncidentKind.MANUAL and inc.action == "manual: operator says so"
    assert [i.id for i in client.job_incidents(job_id).data] == [inc.id]
    everything = client.list_incidents()
    assert everything.count == 1 and everything.data[0].id == inc.id
    assert client.list_incidents(job_id=job_id, limit=1).data[0].id == inc.id
    assert client.list_incidents(job_id="job_other").count == 0
    assert client.job_checkpoints(job_id).count == 0
    stacks = client.job_stacks(job_id)
    assert stacks.job_id == job_id and stacks.groups == [] and stacks.stacks == {}


def test_evict_and_readmit(running: tuple[VigilClient, str]) -> None:
    client, _ = running
    out = client.evict_node(NODE, deadline_s=3)
    assert out.node_id == NODE and out.state is NodeState.EVICTED and out.outcome
    back = client.readmit_node(NODE)
    assert (back.node_id, back.state, back.outcome) == (NODE, NodeState.ALIVE, None)
    with pytest.raises(ApiError) as not_evicted:
        client.readmit_node(NODE)
    assert not_evicted.value.status_code == 409
    with pytest.raises(ApiError) as bad_deadline:
        client.evict_node(NODE, deadline_s=0)
    assert bad_deadline.value.status_code == 422
