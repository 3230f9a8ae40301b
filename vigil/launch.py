"""Script entry points run as torchrun runs them: each rank a process of its own, with torchrun's environment.

``entrypoint: "python train.py --epochs 3"`` runs ``train.py`` as ``__main__`` in a child process of each
Ray Train worker (:func:`run_script`), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets them, so a script written for torchrun calls
``dist.init_process_group()`` itself and runs unchanged, ``if __name__ == "__main__":``, its own
arguments, its own checkpoints and all. The child starts as ``python -m vigil.launch train.py ...``:
before the script runs it installs torch's global optimizer-step hooks, which open the rank's Vigil
session at the first optimizer step (when the script has made its process group) and from then on
delimit its steps (:mod:`vigil.rank.autostep`); the session reads the collectives from the Flight
Recorder and watches for stalls as for any rank. A script that uses the rank API (``vigil.init()``)
gets the same session at once (:func:`vigil.launch_context.context_from_env`; its process group made from the same
environment if the script made none).

The child's Vigil context (job, node agent socket, fault file, checkpoint root, the job spec and
``config``) comes in a JSON file named by :data:`CONTEXT_ENV`. The child dies with its parent
(``PR_SET_PDEATHSIG``); a child that exits with a non-zero status fails the rank, and Ray Train restarts
the group as for any failure. What the child cannot do from its own process: hand Ray Train checkpoints
or see a drain coming (Ray Train's calls live in the parent); its checkpoints are found on restart in
the job's checkpoint root (Vigil's) or wherever the script keeps its own.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vigil.contract.schemas import TRAINING_THREAD
from vigil.launch_context import CONTEXT_ENV, launched

log = logging.getLogger(__name__)

SUMMARY_NAME = "summary.json"
PARENT_ENV = "VIGIL_LAUNCH_PARENT"
JOB_DIR_ENV = "VIGIL_JOB_DIR"
"""A folder of the job on the storage every node sees (``<storage>/<job>/files``), handed to script ranks for
their own checkpoints and outputs; the same across restarts of the job."""


def write_context(path: Path, *, job_id: str, node_id: str, socket_path: str, fault_file: str | None,
                  checkpoint_root: str, restore_dir: str | None, report_interval: int, spec: dict[str, Any],
                  config: dict[str, Any]) -> Path:
    path.write_text(json.dumps({
        "job_id": job_id, "node_id": node_id, "socket_path": socket_path, "fault_file": fault_file,
        "checkpoint_root": checkpoint_root, "restore_dir": restore_dir, "report_interval": report_interval,
        "spec": spec, "config": config, "summary": str(path.with_name(SUMMARY_NAME)),
    }))
    return path


class _Bootstrap:
    """torch's global optimizer-step hooks of a launched rank: open the session at the first optimizer
    step (the script has its process group by then), then hand every hook to it."""

    def __init__(self) -> None:
        self.opening = False

    def pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        from vigil import sdk

        s = sdk._current
        if s is not None and not s.closed:
            s._torch_optimizer_pre(optimizer, args, kwargs)

    def post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        from vigil import sdk

        s = sdk._current
        if s is None or s.closed:
            import torch.distributed as dist

            if self.opening or (int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()):
                return  # no process group yet: not a training step of this job
            self.opening = True
            s = sdk.init()
        s._torch_optimizer_post(optimizer, args, kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vigil.launch SCRIPT ARGS...``: run SCRIPT as ``__main__`` under a Vigil session."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from vigil import sdk

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m vigil.launch SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    _die_with_parent()
    threading.current_thread().name = TRAINING_THREAD  # py-spy names the training thread by this
    ctx = launched()
    boot = _Bootstrap()
    hooks = [register_optimizer_step_pre_hook(boot.pre), register_optimizer_step_post_hook(boot.post)]
    script = str(Path(args[0]).resolve())
    sys.argv = [args[0], *args[1:]]
    sys.path.insert(0, str(Path(script).parent))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        sdk.abort()
        raise
    finally:
        for h in hooks:
            h.remove()
    session = sdk._current
    summary = session.summary if session is not None else None
    if status == 0:
        sdk.close()
    else:
        sdk.abort()
    if session is not None:
        session.ctx.telemetry.close()  # deliver what the agent has not taken yet
    if ctx is not None and summary is not None and ctx.get("summary"):
        Path(ctx["summary"]).write_text(json.dumps({
            "step": summary.final_step, "loss": summary.losses.get(summary.final_step),
            "checkpoints": summary.checkpoints}))
    return int(status)


# -- the parent's side (a Ray Train worker) ------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent (the Ray Train worker) dies; gone already: exit now."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's own cleanup stops the child
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):
        os._exit(1)  # the parent died before the line above


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_script(script: str, script_args: Sequence[str], *, rank: int, world_size: int, local_rank: int,
               local_world_size: int, master_addr: str, master_port: int, context_file: Path,
               job_dir: Path | str | None = None) -> dict[str, Any]:
    """Run the script as this rank's child process (module docstring); its summary. Raises when it fails.
    ``job_dir``: a folder of this job on storage every node sees, for the script's own files
    (:data:`JOB_DIR_ENV`); a URI (``s3://...``) when the job's storage is an object store."""
    env = {
        **os.environ,
        **({JOB_DIR_ENV: str(job_dir)} if job_dir is not None else {}),
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": context_file.parent.name, CONTEXT_ENV: str(context_file),
    }
    cmd = [sys.executable, "-m", "vigil.launch", script, *script_args]
    log.info("rank %d: launching %s (MASTER %s:%d)", rank, " ".join(cmd[3:]), master_addr, master_port)
    proc = subprocess.Popen(cmd, env={**env, PARENT_ENV: str(os.getpid())})
    try:
        status = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if status != 0:
        raise RuntimeError(f"script {script} exited with status {status} on rank {rank}")
    summary = context_file.with_name(SUMMARY_NAME)
    return dict(json.loads(summary.read_text())) if summary.is_file() else {}


if __name__ == "__main__":
    sys.exit(main())
