"""End to end: the telemetry of a real 2-rank job on a real multi-node local Ray cluster.

The end-to-end modules' shared cluster (tests/e2e/conftest.py: head + 3 worker raylets of one CPU, an agent
per node, the controller on SQLite); a DDP AdamW job on 2 ranks of 1 CPU each, so they run on two different
nodes. Only this job's telemetry is judged, so the cluster's other jobs (before it) do not matter. Checked over REST:
every step of every rank arrived, every collective of every step (per step and rank, the call
numbers 0..k-1 with the same k on both ranks), and the per-step aggregates agree with the raw
calls they were computed from (p50 / max / slowest rank / wait / transfer / bytes per kind, the
per-rank wait). Then Prometheus' /metrics is scraped and parsed.

Needs: nothing outside the venv (Ray token auth on, as `vigil up` runs it). About a minute or two.
"""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ops.localcluster import LocalCluster
from vigil.contract.client import VigilClient
from vigil.contract.probe import wait_for
from vigil.contract.schemas import JobCreate, JobStatus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 30


def test_every_collective_of_every_step_and_consistent_aggregates(shared_cluster: LocalCluster) -> None:
    cluster = shared_cluster
    with VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=60) as client:
        spec = JobCreate.model_validate({
            "name": "e2e-telemetry",
            "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "data": {"max_bytes": 300_000},
            "optimizer": {"kind": "adamw", "lr": 0.01},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
            "steps": STEPS, "batch_size": 8,
            "lr_schedule": {"kind": "constant", "warmup_steps": 0},
        })
        job = client.submit_job(spec)
        status = wait_for(lambda: (s := client.get_job(job.id).status).is_terminal() and s, 600, "the job to end")
        assert status == JobStatus.SUCCEEDED, client.job_logs(job.id).logs[-3000:]

        # Every step of both ranks, aggregated (final) once settled.
        def all_final() -> bool:
            st = client.job_steps(job.id)
            return len(st.data) == 2 and all(len(d.step) == STEPS + 1 and all(d.final) for d in st.data)

        wait_for(all_final, 120, "every step of both ranks aggregated")
        steps = client.job_steps(job.id)
        assert [d.rank for d in steps.data] == [0, 1]
        # Step 0: the start-up collectives (rank 0's weights broadcast), no training step.
        assert all(d.step == list(range(STEPS + 1)) and d.loss[0] is None and d.collectives[0] >= 1
                   for d in steps.data)
        assert steps.data[0].node_id != steps.data[1].node_id, "the two ranks should run on two nodes"

        # Every collective of every step, from the raw per-rank calls.
        out = client.job_collectives(job.id, raw=True, raw_limit=200_000, max_points=100_000)
        assert out.raw is not None and not out.raw_truncated
        seqs: dict[tuple[int, int], set[int]] = defaultdict(set)
        calls: dict[tuple[int, int, int], object] = {}
        for c in out.raw:
            assert (c.step, c.rank, c.seq) not in calls, "a collective arrived twice"
            seqs[(c.step, c.rank)].add(c.seq)
            calls[(c.step, c.rank, c.seq)] = c
        for step in range(1, STEPS + 1):
            k = len(seqs[(step, 0)])
            assert k >= 1, f"step {step}: no collective from rank 0"
            for rank in (0, 1):
                assert seqs[(step, rank)] == set(range(k)), f"step {step} rank {rank}: {sorted(seqs[(step, rank)])}"
        assert all(st in range(STEPS + 1) for st, _ in seqs)  # nothing from steps that never ran

        # The aggregates agree with the raw calls.
        by_kind = {(s.op, s.group, s.tag): s for s in out.data}
        for step in range(1, STEPS + 1):
            fastest = {q: min(calls[(step, r, q)].duration_s for r in (0, 1))  # type: ignore[attr-defined]
                       for q in seqs[(step, 0)]}
            for (op, group, tag), series in by_kind.items():
                mine = {r: [c for (st, rr, _), c in calls.items() if st == step and rr == r and
                            (c.op, c.group, c.tag) == (op, group, tag)] for r in (0, 1)}  # type: ignore[attr-defined]
                if not mine[0]:
                    continue
                i = series.step.index(step)
                dur = {r: sum(c.duration_s for c in mine[r]) for r in (0, 1)}  # type: ignore[attr-defined]
                wait = {r: sum(c.duration_s - fastest[c.seq] for c in mine[r]) for r in (0, 1)}  # type: ignore[attr-defined]
                assert series.max_s[i] == pytest.approx(max(dur.values()))
                assert series.p50_s[i] == pytest.approx(min(dur.values()))  # lower median of two
                assert series.slowest_rank[i] == max((0, 1), key=lambda r: (dur[r], -r))
                assert series.wait_max_s[i] == pytest.approx(max(wait.values()), abs=1e-9)
                assert series.transfer_s[i] == pytest.approx(sum(fastest[c.seq] for c in mine[0]))  # type: ignore[attr-defined]
                assert series.calls[i] == len(mine[0]) and series.ranks[i] == 2
                assert series.wire_bytes[i] == sum(c.wire_bytes for r in (0, 1) for c in mine[r])  # type: ignore[attr-defined]
            for d in steps.data:
                i = d.step.index(step)
                own = [calls[(step, d.rank, q)] for q in seqs[(step, d.rank)]]
                assert d.comm_wait_s[i] == pytest.approx(
                    sum(c.duration_s - fastest[c.seq] for c in own), abs=1e-9)  # type: ignore[attr-defined]
                assert d.collectives[i] == len(own)

        # Prometheus: every node's heartbeat age and NIC rates, parsed.
        text = httpx.get(f"{cluster.controller_url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {cluster.admin_token}"}).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        ages = {s.labels["node"]: s.value for s in fams["vigil_node_heartbeat_age_seconds"].samples}
        assert set(ages) >= set(cluster.node_ids) and all(a < 30 for a in ages.values())
        assert fams["vigil_jobs"].samples and fams["vigil_node_nic_receive_bytes_per_second"].samples
