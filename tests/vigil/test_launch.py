"""Script ranks launched as torchrun launches them (vigil.launch), without Ray: two real processes per run
with torchrun's environment, a real unix datagram socket standing in for the node agent, and the
bundled torchrun example, which imports nothing of Vigil.

Needs: a free TCP port on 127.0.0.1 and a short path for the socket (/tmp). Each run under a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from vigil.bench.ranks import free_port
from vigil.capture import FR_BUFFER_ENV
from vigil.contract.schemas import CAPTURED_TAG, JobCreate
from vigil.contract.settings import fault_file_path
from vigil.launch import CONTEXT_ENV, JOB_DIR_ENV, PARENT_ENV, write_context

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrun_script" / "train.py"


class Agent:
    """A unix datagram socket that keeps what the ranks send (JSON arrays of samples)."""

    def __init__(self, folder: Path) -> None:
        self.path = str(folder / "agent.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples += json.loads(self.sock.recv(1 << 17))
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def _launch(tmp: Path, agent: Agent, args: list[str], *, fault: dict[str, Any] | None = None,
            world: int = 2) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    job_dir = tmp / "job"
    procs = []
    for rank in range(world):
        folder = tmp / f"rank{rank}"
        folder.mkdir(exist_ok=True)
        ff = fault_file_path(tmp / "run", "job-tr", rank)
        if fault is not None and fault["rank"] == rank:
            ff.parent.mkdir(parents=True, exist_ok=True)
            ff.write_text(json.dumps({k: v for k, v in fault.items() if k != "rank"}))
        ctx = write_context(folder / "context.json", job_id="job-tr", node_id="n", socket_path=agent.path,
                            fault_file=str(ff), checkpoint_root=str(tmp / "vigil-ckpt"), restore_dir=None,
                            report_interval=10, spec=JobCreate(name="tr", steps=40).model_dump(mode="json"), config={})
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               CONTEXT_ENV: str(ctx), JOB_DIR_ENV: str(job_dir), FR_BUFFER_ENV: "500", PARENT_ENV: str(os.getpid()),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "vigil.launch", str(SCRIPT), *args], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


@pytest.fixture
def tmp() -> Any:
    with tempfile.TemporaryDirectory(prefix="vgl-") as d:  # short: a unix socket path has ~100 bytes
        yield Path(d)


def test_a_torchrun_script_runs_unchanged_and_is_stepped_with_its_collectives(tmp: Path) -> None:
    agent = Agent(tmp)
    try:
        runs = _launch(tmp, agent, ["--steps", "40", "--checkpoint-every", "20"])
    finally:
        agent.close()
    assert [r.returncode for r in runs] == [0, 0], [r.stdout[-3000:] for r in runs]
    steps = {r: sorted(s["step"] for s in agent.samples if s["kind"] == "step" and s["rank"] == r) for r in (0, 1)}
    # The first optimizer step starts the clock; then every step, numbered by AdamW's own count.
    assert steps == {0: list(range(2, 41)), 1: list(range(2, 41))}
    ddp = [s for s in agent.samples if s["kind"] == "collective" and s["op"] == "all_reduce" and s["tag"] == CAPTURED_TAG]
    assert {s["step"] for s in ddp if s["rank"] == 0} >= set(range(2, 41))
    pids = {s["pid"] for s in agent.samples if s["kind"] == "step"}
    assert len(pids) == 2 and os.getpid() not in pids  # each rank its own process
    assert (tmp / "job" / "checkpoints" / "last.pt").is_file()  # the script's own checkpoint, where it was told


def test_a_killed_script_rank_fails_and_the_next_start_resumes_from_the_scripts_checkpoint(tmp: Path) -> None:
    agent = Agent(tmp)
    try:
        first = _launch(tmp, agent, ["--steps", "40", "--checkpoint-every", "10", "--step-delay", "0.01"],
                        fault={"rank": 1, "kind": "kill_rank", "step": 25, "fault_id": 1})
        assert first[1].returncode == -9  # SIGKILLed by its own fault at step 25
        again = _launch(tmp, agent, ["--steps", "40", "--checkpoint-every", "10"])
    finally:
        agent.close()
    assert [r.returncode for r in again] == [0, 0], [r.stdout[-3000:] for r in again]
    assert "resumed from step 20" in again[0].stdout
    hits = [s for s in agent.samples if s["kind"] == "fault"]
    assert [(h["rank"], h["step"]) for h in hits] == [(1, 25)]
