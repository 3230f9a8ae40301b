"""Live recovery on a real Ray cluster: ``python -m vigil`` with ``recovery.policy: live`` (torchft replicas
as Ray actors, the lighthouse in the driver), a replica killed with SIGKILL in the middle of the run.

A head and one worker raylet on this machine (4 logical CPUs each: the faulty run and a fault-free twin side
by side, with room for a replacement), the real driver as a subprocess (as a Ray job runs it). The loop is a user's
(:mod:`tests.vigil.live_entry`): after every step each rank writes its pid, the time, its loss and a
hash of its parameters' bytes. What must hold: the survivors' step counter never stops (every step
once, from one process, no long pause), the replacement heals from a live peer and from then on holds
bitwise the survivors' parameters at every step, and the loss ends where a fault-free run's does.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vigil.live_rig import driver, finish, records
from vigil import checkpointing as checkpoint
from vigil.contract.schemas import JobCreate

pytestmark = pytest.mark.slow

STEPS = 250
KILL_AT = 40
RANKS = 3


def _spec(out: Path, **recovery: Any) -> JobCreate:
    return JobCreate(
        name="live", entrypoint="tests.vigil.live_entry:train_func",
        # Two features, eight classes: overlapping blobs, so the loss stays well above zero to compare.
        config={"out": str(out), "step_sleep_s": 0.04, "samples": 4096, "batch_size": 32, "features": 2,
                "classes": 8, "hidden": 32},
        optimizer={"kind": "adamw", "lr": 5e-3},
        scaling={"min_workers": 2, "max_workers": RANKS, "cpus_per_worker": 1},
        steps=STEPS, checkpoint={"interval_steps": 50, "keep_last": 2},
        recovery={"policy": "live", "max_restarts": 3, **recovery},
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        # 4 CPUs each (logical: the replicas mostly sleep): the faulty and the fault-free run side by side,
        # with room for a replacement.
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        c.add_node(num_cpus=4)
        c.wait_for_nodes()
        try:
            yield c
        finally:
            c.shutdown()


def test_a_killed_replica_is_replaced_and_healed_while_the_survivors_train_on(
        cluster: Any, tmp_path: Path) -> None:
    out, clean_out = tmp_path / "faulty", tmp_path / "clean"
    out.mkdir()
    clean_out.mkdir()
    proc = driver(cluster.address, _spec(out), "live-kill", tmp_path / "storage")
    clean_proc = driver(cluster.address, _spec(clean_out), "live-clean", tmp_path / "storage")
    deadline = time.monotonic() + 120
    victim: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        recs = records(out, RANKS)[1]
        if recs and recs[-1]["step"] >= KILL_AT:
            victim = recs[-1]
            break
        time.sleep(0.05)
    assert victim is not None, "rank 1 did not reach the kill step"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.time()
    output = finish(proc)

    recs = records(out, RANKS)
    # The survivors: every step once, in order, from one process; their steps never stopped for long.
    for r in (0, 2):
        steps = [x["step"] for x in recs[r]]
        assert steps == list(range(1, STEPS + 1)), f"rank {r}"
        assert len({x["pid"] for x in recs[r]}) == 1, f"rank {r} restarted"
        ts = [x["ts"] for x in recs[r]]
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        assert max(gaps) < 8.0, f"rank {r} paused {max(gaps):.1f} s"
    # The replacement: a new process that healed from a peer at a step the survivors had reached, then
    # ran every later step with exactly the survivors' parameters (and the same data position).
    pids = list(dict.fromkeys(x["pid"] for x in recs[1]))
    assert len(pids) == 2 and pids[0] == victim["pid"], pids
    after = [x for x in recs[1] if x["pid"] == pids[1]]
    healed = after[0]["start"] - 1
    assert healed >= victim["step"] and [x["step"] for x in after] == list(range(healed + 1, STEPS + 1))
    survivor = {x["step"]: x for x in recs[0]}
    assert all(x["params"] == survivor[x["step"]]["params"] for x in after)
    assert all(x["params"] == survivor[x["step"]]["params"] for x in recs[2])
    rejoin_s = after[0]["ts"] - killed_at
    assert rejoin_s < 60, f"replacement back after {rejoin_s:.1f} s"
    assert "SUCCEEDED" in output

    # Disk checkpoints (for whole-job failures) were written by one replica, each complete.
    root = checkpoint.job_root(tmp_path / "storage", "live-kill")
    steps = [s for s, _ in checkpoint.list_step_dirs(root)]
    assert steps == [STEPS - 50, STEPS]
    for _, d in checkpoint.list_step_dirs(root):
        assert checkpoint.verify(d).world_size == 1

    # The loss ends where a fault-free run's does (the survivors averaged over two replicas for a while).
    finish(clean_proc)
    clean = records(clean_out, RANKS)[0]
    def tail(rs: list[dict[str, Any]]) -> float:
        return sum(x["loss"] for x in rs[-50:]) / 50

    assert abs(tail(recs[0]) - tail(clean)) < 0.1 * tail(clean) + 0.02, (tail(recs[0]), tail(clean))
    print(f"rejoin {rejoin_s:.1f} s; healed at step {healed}; loss tail {tail(recs[0]):.4f} vs clean {tail(clean):.4f}")


def test_a_trained_job_is_not_held_by_a_replica_that_never_finishes(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once one replica ran the last step the job is trained: a replica Ray cannot place (its nodes evicted)
    gets FINISH_GRACE_S, then is given up; a replica whose code raised still fails the job."""
    import ray

    from vigil import live_replicas as live_driver

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address)
    try:
        @ray.remote(num_cpus=0)
        def finished(rank: int) -> dict[str, Any]:
            return {"rank": rank, "step": 5}

        @ray.remote(num_cpus=0)
        def stuck() -> None:
            time.sleep(600)

        @ray.remote(num_cpus=0, max_retries=0)
        def raises() -> None:
            raise ValueError("the user's code failed")

        monkeypatch.setattr(live_driver, "FINISH_GRACE_S", 1.0)
        t = time.monotonic()
        out = live_driver._gather({stuck.remote(): 1, finished.remote(0): 0}, steps=5)
        assert list(out) == [0] and time.monotonic() - t < 30
        with pytest.raises(ray.exceptions.RayTaskError, match="the user's code failed"):
            live_driver._gather({raises.remote(): 0, finished.remote(1): 1}, steps=5)
    finally:
        ray.shutdown()
