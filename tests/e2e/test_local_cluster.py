"""End to end: a real multi-node local Ray cluster (head + 2 worker raylets of 4 logical CPUs), a real agent
per node, the real controller over HTTP with SQLite: the paper optimizers as submitted jobs, then a 2-rank DDP
AdamW job of a few dozen steps, after which the cluster stops and leaves no process behind (one cluster start
for both: the stop is the last test's).

The client carries the admin token `vigil up` wrote to <home>/admin-token (mode 600), as the CLI
does; the agents and the job's driver carry the tokens `vigil up` and the controller gave them.

Needs: nothing outside the venv (Ray token auth on, as `vigil up` runs it). Takes about a minute.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest

from ops.localcluster import LocalCluster, free_port, start_local_cluster
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import JobCreate, JobStatus
from vigil.contract.settings import admin_token_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Room for all four 2-rank paper jobs at once (logical CPUs: the ranks take turns on the real ones).
    c = start_local_cluster(tmp_path_factory.mktemp("local") / "home", nodes=2, cpus_per_node=4, port=free_port())
    try:
        yield c
    finally:
        c.stop(discard_storage=True)  # a second stop after the last test's: nothing left to do


def _wait_terminal(client: VigilClient, job_id: str, timeout: float) -> JobStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get_job(job_id).status
        if status.is_terminal():
            return status
        time.sleep(1)
    raise TimeoutError(f"job {job_id} still {status} after {timeout}s")


# The compressed-communication methods of ALGORITHMS.md as a user submits them, each with the kinds of
# collective (tags) it must make: sign momentum's sync, SDP4Bit's 4-bit weights, CSER's compressed
# gradients and resets, two-way compressed Adam's push and pull.
PAPER_METHODS = [
    ("dsm", {"tau": 4}, {"sync"}),
    ("sdp4bit", {}, {"weights"}),
    ("cser", {}, {"grads", "reset"}),
    ("compressed_adam", {"compressor": "onebit"}, {"push", "pull"}),
]


def test_paper_optimizers_run_as_submitted_jobs(cluster: LocalCluster) -> None:
    with VigilClient(cluster.controller_url, token=cluster.admin_token) as client:
        jobs = {}
        for kind, params, _ in PAPER_METHODS:
            spec = JobCreate.model_validate({
                "name": f"e2e-{kind}",
                "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
                "data": {"max_bytes": 300_000},
                "optimizer": {"kind": kind, "lr": 0.3 if kind == "cser" else 0.01, "params": params},
                "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
                "steps": 24, "batch_size": 8,
                "lr_schedule": {"kind": "constant", "warmup_steps": 0},
            })
            jobs[kind] = client.submit_job(spec).id
        for kind, _, tags in PAPER_METHODS:
            job_id = jobs[kind]
            status = _wait_terminal(client, job_id, timeout=300)
            assert status == JobStatus.SUCCEEDED, f"{kind}: {client.get_job(job_id).message}\n" \
                f"{client.job_logs(job_id).logs[-3000:]}"
            # The agents post the last steps' samples and the aggregates settle shortly after the job ends.
            deadline = time.monotonic() + 30
            while True:
                metrics = client.job_metrics(job_id)
                seen = {c.tag for c in client.job_collectives(job_id).data}
                last = [s.step[-1] for s in metrics.ranks]
                if (last == [24, 24] and tags <= seen) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert [s.rank for s in metrics.ranks] == [0, 1], kind
            # finite losses (None: NaN or inf) at every training step; step 0 carries the start-up collectives
            assert all(x is not None for s in metrics.ranks for st, x in zip(s.step, s.loss, strict=True) if st > 0), \
                (kind, [s.loss for s in metrics.ranks])
            assert last == [24, 24], f"{kind}: last step per rank {last}"
            assert tags <= seen, f"{kind}: collectives {sorted(seen)}, expected {sorted(tags)}"


def test_two_rank_job_end_to_end_and_the_stop_leaves_nothing_behind(cluster: LocalCluster) -> None:
    tree: list[int] = []
    try:
        token_file = admin_token_path(cluster.home)
        assert token_file.stat().st_mode & 0o777 == 0o600
        with VigilClient(cluster.controller_url) as anonymous:
            assert anonymous.health().status == "ok"  # /healthz stays open
            with pytest.raises(ApiError) as refused:
                anonymous.list_jobs()
        assert refused.value.status_code == 401
        client = VigilClient(cluster.controller_url, token=token_file.read_text().strip())
        nodes = client.list_nodes()
        assert {n.id for n in nodes.data} == set(cluster.node_ids) and len(cluster.node_ids) == 3

        spec = JobCreate.model_validate({
            "name": "e2e-ddp",
            "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "data": {"max_bytes": 300_000},
            "optimizer": {"kind": "adamw", "lr": 0.01},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
            "steps": 40, "batch_size": 8,
            "lr_schedule": {"kind": "constant", "warmup_steps": 0},
        })
        job = client.submit_job(spec)
        assert client.get_job(job.id).name == "e2e-ddp"
        # While it runs, remember every process of the cluster to check that stop() leaves none.
        time.sleep(5)
        tree = [p.pid for c in cluster.procs.children for p in psutil.Process(c.proc.pid).children(recursive=True)]
        tree += [c.proc.pid for c in cluster.procs.children]

        status = _wait_terminal(client, job.id, timeout=300)
        final = client.get_job(job.id)
        assert status == JobStatus.SUCCEEDED, f"{final.message}\n{client.job_logs(job.id).logs[-3000:]}"

        metrics = client.job_metrics(job.id)
        assert [s.rank for s in metrics.ranks] == [0, 1], "step metrics must arrive from every rank"
        for series in metrics.ranks:
            # every training step (not step 0, the start-up broadcast of the weights: /steps shows it)
            assert series.step == list(range(1, 41)), series.step
            assert all(t > 0 for t in series.step_time_s)
        losses = [x for x in metrics.ranks[0].loss if x is not None]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 0.3, f"loss did not fall: first {first:.3f}, last {last:.3f}"
        assert final.last_step is not None and final.last_loss is not None

        listed = client.list_jobs()
        assert job.id in {j.id for j in listed.data}
        events = [e.message for e in client.list_events(job_id=job.id).data]
        assert "PENDING -> RUNNING" in events and "RUNNING -> SUCCEEDED" in events
        logs = client.job_logs(job.id).logs
        assert "Running entrypoint" in logs
        # A rank's line reaches the driver's log once: one Ray log monitor on this host, not one per raylet
        # (each of which watches the same session folder).
        assert logs.count(f"job {job.id}: 2 ranks, adamw") == 1, logs[-3000:]
        (driver_token,) = [t for t in client.list_tokens().data if t.job_id == job.id]
        assert driver_token.role.value == "job" and not driver_token.active  # revoked when the job ended
        client.close()
    finally:
        cluster.stop(discard_storage=True)
    time.sleep(1)
    alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left behind: {alive}"
