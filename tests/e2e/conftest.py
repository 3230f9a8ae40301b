"""One local cluster (head + 3 worker raylets, real agents, the real controller) shared by the end-to-end
modules whose jobs do not disturb each other's nodes: a user's own code (test_user_code.py) and a tenant's
attacks (test_tenant.py). Each start costs about 40 s on this machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controller.client import VigilClient
from controller.localcluster import LocalCluster, free_port, start_local_cluster


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
