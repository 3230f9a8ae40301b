"""End to end: two controllers on one PostgreSQL database; the leader is killed with ``kill -9`` while a
job runs, the standby takes the leadership, and a fault injected after that is detected, blamed on the
right rank and recovered by the standby alone (controller/leader.py, agent/failover.py).

A real local Ray cluster (head with no CPUs + 2 worker raylets, one CPU each), real agents that know
both controllers' URLs, a 2-rank job of a few dozen steps of a tiny model.

Needs: PostgreSQL on 127.0.0.1:5432 (skipped without it). About two minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.localcluster import LocalCluster, free_port, start_local_cluster
from vigil.contract.client import VigilClient
from vigil.contract.probe import wait_for
from vigil.contract.schemas import FaultCreate, JobCreate, JobStatus

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

STEPS = 1200
"""Long enough to train on through the takeover (the agents find the standby after their backoff, up to 10 s) and
take the fault after it: these ranks run tens of steps a second (Ray Train takes their reports every 0.25 s)."""
CKPT = 20


@pytest.fixture
def cluster(tmp_path: Path, postgres_url: str) -> Iterator[LocalCluster]:
    c = start_local_cluster(tmp_path / "home", nodes=2, cpus_per_node=1, port=free_port(), database_url=postgres_url,
                            standby_controllers=1)
    try:
        yield c
    finally:
        c.stop(discard_storage=True)


def _leader(url: str) -> bool:
    return bool(httpx.get(f"{url}/api/v1/healthz", timeout=2).json()["leader"])


def _rank_node(client: VigilClient, job_id: str, rank: int) -> tuple[str, int]:
    """(node, pid) of a live rank of the job, from the agents' heartbeats."""
    def find() -> tuple[str, int] | None:
        for n in client.list_nodes().data:
            for r in n.ranks:
                if r.job_id == job_id and r.rank == rank and r.alive:
                    return n.id, r.pid
        return None

    found = wait_for(find, 30, f"rank {rank} of {job_id} in a heartbeat", 0.5)
    assert found is not None
    return found


def test_the_standby_takes_over_and_recovers_a_fault_injected_after_the_leaders_death(
        cluster: LocalCluster) -> None:
    leader_url, standby_url = cluster.controller_urls
    assert cluster.controller_names == ["controller", "controller-1"]
    assert _leader(leader_url) and not _leader(standby_url)
    spec = JobCreate.model_validate({
        "name": "takeover",
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
        "data": {"max_bytes": 300_000},
        "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "steps": STEPS, "batch_size": 8,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": CKPT, "keep_last": 3},
        "recovery": {"policy": "evict_restart", "max_restarts": 3},
    })
    with VigilClient(leader_url, token=cluster.admin_token, timeout=30) as first:
        job = first.submit_job(spec)
        wait_for(lambda: (first.get_job(job.id).last_step or 0) >= 5, 240, f"{job.id} to reach step 5", 0.5)

    cluster.procs.stop_child(cluster.procs.child("controller"))  # kill -9 of the leader's whole session
    wait_for(lambda: _leader(standby_url), 30, "the standby to take the leadership", 0.2, (httpx.HTTPError,))

    with VigilClient(standby_url, token=cluster.admin_token, timeout=30) as client:
        node, pid = _rank_node(client, job.id, 1)  # the agents' heartbeats reach the standby
        at = (client.get_job(job.id).last_step or 5) + 8
        client.inject_fault(job.id, FaultCreate.model_validate({"kind": "kill_rank", "rank": 1, "step": at}))
        wait_for(lambda: client.get_job(job.id).status.is_terminal(), 300, f"{job.id} to end", 0.5)
        final = client.get_job(job.id)
        assert final.status == JobStatus.SUCCEEDED, f"{final.message}\n{client.job_logs(job.id).logs[-4000:]}"

        died = [i for i in client.job_incidents(job.id).data if i.kind.value == "rank_died"]
        assert len(died) == 1, died  # opened once: by the standby, the only monitor left
        assert died[0].rank == 1 and died[0].node_id == node and died[0].evidence["pid"] == pid
        assert died[0].status.value == "RECOVERED"
        leaders = [e for e in client.list_events(limit=1000).data if e.kind == "controller_leader"]
        assert len(leaders) == 2  # the first controller at its start, the standby at the takeover
        assert not [n.id for n in client.list_nodes().data if n.state.value == "DEAD"]  # no node judged lost
