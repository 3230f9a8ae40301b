"""End to end on a real Ray cluster: ``python -m vigil`` runs Ray Train v2 with 2 ranks over gloo.

Needs Ray 2.60 with Ray Train (``ray.cluster_utils.Cluster``: a head and one worker raylet on this
machine, 2 CPUs each, named ``vigil-node-0`` / ``vigil-node-1`` as ``vigil up`` names them) and
about two minutes. The driver is the real entrypoint, started as a subprocess with ``RAY_ADDRESS``
pointing at the cluster, exactly as a Ray job runs it; Ray's token authentication is left as the
environment has it (on when a token exists) - nothing here disables it. One unix datagram receiver
per node stands in for the node agents, so the telemetry path (Ray node id -> node name -> agent
socket) is real too. Checkpoints: DCP folders with manifests under the job's root in the storage
path, Ray Train holding pointers to them; a resubmission resumes from the newest valid one, also
when the newest is corrupt.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vigil import checkpointing as checkpoint
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import agent_socket_path

pytestmark = pytest.mark.slow

STEPS = 10
SPEC = JobCreate(
    name="ray-integration",
    model={"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
    data={"max_bytes": 200_000, "seed": 1},
    optimizer={"kind": "adamw", "lr": 5e-3},
    scaling={"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
    steps=STEPS,
    batch_size=8,
    eval_interval=5,
    checkpoint={"interval_steps": 5, "keep_last": 2},
    recovery={"max_restarts": 0},
)
DRIVER_TIMEOUT_S = 240  # a safety net on a shared machine; ~45 s per run when it is quiet
NODE_NAMES = ("vigil-node-0", "vigil-node-1")


class AgentStandIn:
    """A bound unix datagram socket per node, drained by a thread, like the agent's receiver."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []  # (node name, sample)
        self._stop = threading.Event()
        self._socks = {}
        for node_id, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(str(path))
            s.settimeout(0.1)
            self._socks[node_id] = s
        self._threads = [threading.Thread(target=self._drain, args=(n, s), daemon=True) for n, s in self._socks.items()]
        for t in self._threads:
            t.start()

    def _drain(self, node_id: str, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data = s.recv(1 << 17)
            except TimeoutError:
                continue
            self.received.extend((node_id, item) for item in json.loads(data))

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        for s in self._socks.values():
            s.close()


@pytest.fixture(scope="module")
def cluster(corpus_cache: Path) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # Raylets (and so every rank) inherit this environment.
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("RAY_TRAIN_V2_ENABLED", "1")
        mp.setenv("VIGIL_CACHE_DIR", str(corpus_cache))
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                          "node_name": NODE_NAMES[0]})
        c.add_node(num_cpus=2, node_name=NODE_NAMES[1])
        c.wait_for_nodes()
        try:
            yield c
        finally:
            c.shutdown()


@pytest.fixture(scope="module")
def run_driver(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run_driver(spec)``: ``python -m vigil`` for job ``itest`` against the cluster, with one
    agent stand-in per node (its socket named by the node's name, as ``vigil up`` runs the agents);
    returns (completed process, received samples, seconds). Every call shares one storage path, as
    resubmissions of one job do."""
    storage = tmp_path_factory.mktemp("storage")

    def run(spec: JobCreate) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, dict[str, Any]]], float]:
        run_dir = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))  # short: unix socket paths max 108 bytes
        agents = AgentStandIn({n: agent_socket_path(run_dir, n) for n in NODE_NAMES})
        env = {
            **os.environ,
            "RAY_ADDRESS": cluster.address,
            "VIGIL_JOB_ID": "itest",
            "VIGIL_JOB_SPEC": spec.model_dump_json(),
            "VIGIL_RUN_DIR": str(run_dir),
            "VIGIL_STORAGE_PATH": str(storage),
        }
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "vigil", "--report-interval", "5"],
                env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, check=False,
            )
        finally:
            time.sleep(0.5)  # let the receivers drain the last datagrams
            agents.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return proc, agents.received, elapsed

    run.storage = storage  # type: ignore[attr-defined]
    run.root = checkpoint.job_root(storage, "itest")  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="module")
def first_run(run_driver: Any) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, dict[str, Any]]], float]:
    return run_driver(SPEC)


def _summary(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    lines = [line for line in proc.stdout.splitlines() if "SUCCEEDED" in line]
    assert lines, proc.stdout[-2000:]
    return dict(kv.split("=", 1) for kv in lines[-1].split() if "=" in kv)


def _checkpoint_samples(received: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, s) for n, s in received if s["kind"] == "checkpoint" and s["job_id"] == "itest"]


def _step_samples(received: list[tuple[str, dict[str, Any]]], rank: int) -> list[dict[str, Any]]:
    mine = [s for _, s in received if s["kind"] == "step" and s["job_id"] == "itest" and s["rank"] == rank]
    return sorted(mine, key=lambda s: s["step"])


def test_python_m_trainer_runs_ray_train_to_the_end(first_run: Any, run_driver: Any) -> None:
    proc, received, elapsed = first_run
    fields = _summary(proc)
    assert fields["step"] == str(STEPS)
    # Ray Train's last reported metrics (rank 0): the loss is well below the uniform guess's ln 256.
    assert float(fields["loss"]) < math.log(256) - 0.5
    assert float(fields["val_loss"]) < math.log(256) - 0.5

    # Telemetry from both ranks, every step, through each rank's own node's socket.
    for rank in (0, 1):
        mine = _step_samples(received, rank)
        assert [s["step"] for s in mine] == list(range(1, STEPS + 1)), f"rank {rank} steps"
        assert all(s["world_size"] == 2 for s in mine)
        assert mine[-1]["loss"] < mine[0]["loss"] - 0.5, f"rank {rank} loss did not fall"
        assert len({n for n, s in received if s["kind"] == "step" and s["rank"] == rank}) == 1  # one node
    # The agents listen on sockets named by node *name* only, so every sample above reached one
    # because its rank resolved its node's name from its Ray node id (Ray placed the ranks).
    assert {n for n, s in received if s["kind"] == "step"} <= set(NODE_NAMES)
    collectives = [s for _, s in received if s["kind"] == "collective"]
    # Every step's, and the start-up broadcast of rank 0's weights (step 0), all through the layer.
    assert {(c["rank"], c["step"]) for c in collectives} == {(r, s) for r in (0, 1) for s in range(STEPS + 1)}
    assert {(c["op"], c["tag"]) for c in collectives if c["step"] == 0} == {("broadcast", "init")}

    # Checkpoints: DCP folders under the job's root (steps 5 and 10, keep_last 2), each valid.
    root = run_driver.root
    assert [s for s, _ in checkpoint.list_step_dirs(root)] == [5, 10]
    for _, d in checkpoint.list_step_dirs(root):
        m = checkpoint.verify(d)
        assert m.world_size == 2 and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(m.files)
    # Rank 0 reported each complete one through its node's agent.
    samples = _checkpoint_samples(received)
    rank0_node = next(n for n, s in received if s["kind"] == "step" and s["rank"] == 0)
    assert [(n, s["step"], s["valid"], s["world_size"]) for n, s in samples] == [
        (rank0_node, 5, True, 2), (rank0_node, 10, True, 2)
    ]
    assert Path(samples[-1][1]["path"]).resolve() == checkpoint.step_dir(root, 10).resolve()
    # Ray Train kept pointers to them (not copies), the newest naming step 10.
    ckpts = sorted(p for p in (run_driver.storage / "vigil-itest").glob("checkpoint_*") if p.is_dir())
    assert ckpts, "Ray Train recorded no checkpoint"
    for c in ckpts:
        assert sorted(p.name for p in c.iterdir()) == [checkpoint.POINTER_FILE]
    assert checkpoint.resolve(ckpts[-1]) == checkpoint.step_dir(root, 10).resolve()
    assert Path(fields["checkpoint"]).resolve() == checkpoint.step_dir(root, 10).resolve()
    print(f"ray integration: driver ran {elapsed:.1f}s")


def test_resubmitted_job_resumes_from_its_last_checkpoint(first_run: Any, run_driver: Any) -> None:
    # The same job id again, with a longer budget: Ray Train finds the run's checkpoints under the
    # storage path, ray.train.get_checkpoint() hands each rank the step-10 checkpoint.
    proc, received, elapsed = run_driver(SPEC.model_copy(update={"steps": STEPS + 2}))
    assert _summary(proc)["step"] == str(STEPS + 2)
    first_losses = {s["step"]: s["loss"] for s in _step_samples(first_run[1], 0)}
    for rank in (0, 1):
        mine = _step_samples(received, rank)
        assert [s["step"] for s in mine] == [STEPS + 1, STEPS + 2], f"rank {rank} did not resume at step 11"
    # Resumed where the first run stopped: the loss carries on from there, not from ln 256.
    assert _step_samples(received, 0)[0]["loss"] < first_losses[1] - 0.5
    print(f"ray integration (resume): driver ran {elapsed:.1f}s")


def test_resubmission_falls_back_past_a_corrupt_newest_checkpoint(first_run: Any, run_driver: Any) -> None:
    # After the resume above the root holds steps 10 and 12, and Ray Train's newest pointer names 12.
    # Corrupt 12 (same size, other bytes): the next run must skip it, say so, and resume from 10.
    root = run_driver.root
    assert [s for s, _ in checkpoint.list_step_dirs(root)] == [10, 12]
    newest = checkpoint.step_dir(root, 12)
    data = newest / "__1_0.distcp"
    with data.open("r+b") as f:
        f.seek(data.stat().st_size // 2)
        f.write(b"\xff" * 64)
    proc, received, elapsed = run_driver(SPEC.model_copy(update={"steps": STEPS + 4}))
    assert _summary(proc)["step"] == str(STEPS + 4)
    for rank in (0, 1):
        assert [s["step"] for s in _step_samples(received, rank)] == [11, 12, 13, 14], f"rank {rank}"
    bad = [s for _, s in _checkpoint_samples(received) if not s["valid"]]
    assert [(s["step"], Path(s["path"]).resolve()) for s in bad] == [(12, newest.resolve())]
    assert "checksum" in bad[0]["message"]
    good = [s["step"] for _, s in _checkpoint_samples(received) if s["valid"]]
    assert good[-1] == STEPS + 4
    assert checkpoint.verify(checkpoint.step_dir(root, STEPS + 4)).step == STEPS + 4
    print(f"ray integration (corrupt fallback): driver ran {elapsed:.1f}s")


def test_a_run_without_checkpoints_says_where_it_ended(first_run: Any, run_driver: Any) -> None:
    # No checkpoint in this run (interval 0): Ray Train's Result.metrics are the newest checkpoint's report
    # (none of this run's), so the driver's last line takes the step from rank 0's return value. It resumes
    # from step 14 (the test above) and must say 16, which the controller reads (supervisor._final_step).
    spec = SPEC.model_copy(update={"steps": STEPS + 6, "checkpoint": SPEC.checkpoint.model_copy(update={"interval_steps": 0})})
    proc, received, _ = run_driver(spec)
    fields = _summary(proc)
    assert fields["step"] == str(STEPS + 6), proc.stdout[-2000:]
    assert [s["step"] for s in _step_samples(received, 0)] == [15, 16]
    assert float(fields["loss"]) < math.log(256) - 0.5
