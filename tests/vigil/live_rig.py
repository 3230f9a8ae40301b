"""Running live recovery's real driver (``python -m vigil``) against a Ray cluster, and reading what the user's
loop (:mod:`tests.vigil.live_entry`) wrote: shared by the live-recovery tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vigil.contract.schemas import JobCreate

DRIVER_TIMEOUT_S = 300


def records(out: Path, ranks: int) -> dict[int, list[dict[str, Any]]]:
    """Each rank's lines (pid, time, step, loss, parameters' hash), in the order written."""
    recs: dict[int, list[dict[str, Any]]] = {}
    for r in range(ranks):
        path = out / f"rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        recs[r] = [json.loads(line) for line in lines if line.strip()]
    return recs


def driver(address: str, spec: JobCreate, job_id: str, storage: Path) -> subprocess.Popen[str]:
    """The job's driver as a Ray job runs it, connected to the cluster at ``address``."""
    env = {**os.environ, "RAY_ADDRESS": address, "VIGIL_JOB_ID": job_id,
           "VIGIL_JOB_SPEC": spec.model_dump_json(), "VIGIL_RUN_DIR": tempfile.mkdtemp(prefix="vl-", dir="/tmp"),
           "VIGIL_STORAGE_PATH": str(storage)}
    return subprocess.Popen([sys.executable, "-m", "vigil"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str]) -> str:
    """The driver's output once it exited 0 (else the test fails with its output's tail)."""
    try:
        output, _ = proc.communicate(timeout=DRIVER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"driver timed out:\n{output[-6000:]}") from None
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{output[-6000:]}"
    return output
