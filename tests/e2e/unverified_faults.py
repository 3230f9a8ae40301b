"""Fault tests written but NOT yet seen green on a real cluster (the session ran out of time before a
full run): nan_loss rollback, corrupt checkpoint skipped on restore, kill_node, a Ray node removed
from outside. Not collected by `make test` (the file name does not start with ``test_``); move them
back into test_faults.py once they have passed. They use that module's fixtures and helpers.
"""

from tests.e2e.test_faults import *  # noqa: F403 - fixtures and helpers of the verified fault tests
from tests.e2e.test_faults import _finish, _incidents, _inject, _reach, _worker_rank, _assert_resumed_from_checkpoint, _wait  # noqa: F401,E501


def test_nan_loss_rolls_back(client: VigilClient) -> None:
    job = client.submit_job(_spec("nan", policy="rollback"))
    _reach(client, job.id, 5)
    _inject(client, job.id, {"kind": "nan_loss", "rank": 0, "step": 35})
    _finish(client, job.id)
    inc = [i for i in _incidents(client, job.id) if i["kind"] == "nan_loss"]
    assert inc and inc[0]["evidence"]["step"] >= 35 and inc[0]["status"] == "RECOVERED"
    final = client.get_job(job.id)
    assert final.last_loss is not None and final.last_loss == final.last_loss  # finite at the end
    _assert_resumed_from_checkpoint(client, job.id)


def test_corrupt_checkpoint_is_skipped_on_restore(client: VigilClient) -> None:
    job = client.submit_job(_spec("corrupt"))
    _reach(client, job.id, 32)
    _inject(client, job.id, {"kind": "corrupt_checkpoint", "step": 32})
    faults = _wait(lambda: [f for f in client._request("GET", f"/api/v1/jobs/{job.id}/faults")["data"]
                            if f["status"] == "FIRED"], 60, "the corruption")
    corrupted_step = int(faults[0]["message"].split("step ")[-1].rstrip(")")) if "step" in faults[0]["message"] else None
    _inject(client, job.id, {"kind": "kill_rank", "rank": 1, "step": 0})
    _finish(client, job.id)
    cks = client._request("GET", f"/api/v1/jobs/{job.id}/checkpoints")["data"]
    bad = [c for c in cks if not c["valid"]]
    assert bad, f"the corrupt checkpoint was not found out: {cks} (corrupted at step {corrupted_step})"
    _assert_resumed_from_checkpoint(client, job.id)


def test_kill_node_via_api(client: VigilClient) -> None:
    job = client.submit_job(_spec("kill-node"))
    _reach(client, job.id, 25)
    rank, node, _pid = _worker_rank(client, job.id)
    _inject(client, job.id, {"kind": "kill_node", "rank": rank, "step": 25})
    _finish(client, job.id)
    inc = [i for i in _incidents(client, job.id) if i["kind"] == "node_lost"]
    assert inc and inc[0]["node_id"] == node
    assert {n.id: n.state.value for n in client.list_nodes().data}[node] == "DEAD"
    _assert_resumed_from_checkpoint(client, job.id)


def test_ray_node_removed_from_outside(client: VigilClient, cluster: LocalCluster) -> None:
    job = client.submit_job(_spec("remove-node"))
    _reach(client, job.id, 25)
    _rank, node, _pid = _worker_rank(client, job.id)
    # Remove the Ray node and its agent, as a host that dies would: kill their process trees.
    for child in cluster.procs.children:
        if child.name in (f"ray-node-{node.rsplit('-', 1)[1]}", f"agent-{node.rsplit('-', 1)[1]}"):
            for p in [*psutil.Process(child.proc.pid).children(recursive=True), psutil.Process(child.proc.pid)]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    _finish(client, job.id)
    inc = [i for i in _incidents(client, job.id) if i["kind"] == "node_lost"]
    assert inc and inc[0]["node_id"] == node
    _assert_resumed_from_checkpoint(client, job.id)


