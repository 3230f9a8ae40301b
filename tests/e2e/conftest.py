"""One local cluster (head + 3 worker raylets, real agents, the real controller) shared by the end-to-end
modules whose jobs do not disturb each other's nodes: a user's own code (test_user_code.py) and a tenant's
attacks (test_tenant.py). Each start costs about 40 s on this machine.

The tests on the shared cluster run last, one after another: it then runs alone, never beside a module's own
cluster (which stops when its module ends). Two clusters at once on this 2-core machine slow each other's
jobs, and both name their nodes ``vigil-node-<i>``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controller.client import VigilClient
from ops.localcluster import LocalCluster, free_port, start_local_cluster


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use :func:`shared_cluster` after all others (stable order within each part)."""
    shared = [i for i in items if "shared_cluster" in getattr(i, "fixturenames", ())]
    if shared:
        ids = {id(i) for i in shared}
        items[:] = [i for i in items if id(i) not in ids] + shared


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
