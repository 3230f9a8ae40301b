"""One local cluster (head + 3 worker raylets, real agents, the real controller) shared by the end-to-end
modules whose jobs do not disturb each other's nodes: a user's own code (test_user_code.py) and a tenant's
attacks (test_tenant.py). Each start costs about 40 s on this machine.

The tests on the shared cluster run last, one after another: it then runs alone, never beside a module's own
cluster (which stops when its module ends). Two clusters at once on this 2-core machine slow each other's
jobs, and both name their nodes ``vigil-node-<i>``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.localcluster import LocalCluster, free_port, start_local_cluster
from vigil.contract.client import VigilClient


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use :func:`shared_cluster` after all others (stable order within each part)."""
    shared = [i for i in items if "shared_cluster" in getattr(i, "fixturenames", ())]
    if shared:
        ids = {id(i) for i in shared}
        items[:] = [i for i in items if id(i) not in ids] + shared


LOG_TAIL_LINES = 80
"""How much of each of the shared cluster's logs a failed test's report carries: a run in CI leaves nothing
else behind to read."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test on the shared cluster reports the tail of the controller's and agents' logs."""
    outcome = yield
    rep = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("shared_cluster")
    if rep.when != "call" or not rep.failed or cluster is None:
        return
    for path in sorted(Path(cluster.home, "logs").glob("*.log")):
        if path.name.startswith(("controller", "agent")):
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            rep.sections.append((f"shared cluster {path.name} (last {len(lines)} lines)", "\n".join(lines)))


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_local_cluster(tmp_path_factory.mktemp("shared") / "home", nodes=3, cpus_per_node=1, port=free_port())
    try:
        yield c
    finally:
        c.stop(discard_storage=True)


@pytest.fixture
def shared_client(shared_cluster: LocalCluster) -> Iterator[VigilClient]:
    with VigilClient(shared_cluster.controller_url, token=shared_cluster.admin_token, timeout=30) as c:
        yield c
