"""End to end: a job is a tenant (issue 23). Its code, in its driver and in every rank on `vigil up`, tries
what an attacker would (ops/bench/security.py, the attacks of ``vigil bench security``): read Vigil's
secrets (its environment, the admin token and the database in the controller's home, the agents' and the
controller's environment under /proc), signal Vigil's processes, point the root agent at a process that is not
its own, speak for another job through the agents, and inject faults with its own token. Every attempt must be
refused. Slow: shares the cluster of tests/e2e/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.bench.security import report, run_attacks
from ops.localcluster import LocalCluster
from vigil.contract.client import VigilClient

pytestmark = pytest.mark.slow


def test_a_jobs_code_reaches_no_secret_no_process_and_no_other_job_of_vigils(
    shared_cluster: LocalCluster, shared_client: VigilClient, tmp_path: Path
) -> None:
    attacks = run_attacks(shared_cluster, shared_client, tmp_path)
    allowed = [a for a in attacks if not a.refused]
    assert not allowed, "\n".join(f"{a.where} {a.name}: {a.detail}" for a in allowed)
    names = {a.name for a in attacks}
    assert len(names) >= 11 and len(attacks) >= 3 * 9, sorted(names)  # every attack, by the driver and both ranks
    out = report(attacks)
    assert out["secrets_readable_by_job"] == 0 and out["other_jobs_affected"] == 0
    assert out["attacks_refused"] == out["attacks_tried"] == len(attacks)
    if shared_cluster.rank_user is not None:  # vigil up as root (this machine, CI): the ranks are not root
        assert any(a.name == "read the admin token" and a.detail == "PermissionError" for a in attacks)
