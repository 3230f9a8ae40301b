"""Vigil's side of every rank under Ray Train: open the rank's session, run the job's entry point, close.

The job's ``entrypoint`` (:func:`vigil.contract.schemas.parse_entrypoint`) is either a function
``package.module:function``, called with the job's ``config`` (Ray Train's ``train_loop_per_worker``
style), or a script ``python train.py args...``, run as ``__main__`` with those arguments on every
rank (torchrun style). Either way the user's code reaches Vigil through :mod:`vigil.sdk`: the
session is open before it starts, with the rank's telemetry sink (the node agent's socket), fault
file, checkpoint root, the checkpoint Ray Train hands back and Ray Train's preemption signal.
The code comes from the job's ``working_dir`` (Ray unpacks it and makes it the working directory
and an import root of the driver and of every rank), or from what is installed.

The module imports the rank runtime (:mod:`vigil.sdk`, :mod:`vigil.checkpointing`: torch and its distributed
checkpoint stack) only inside the functions that run a rank: the driver (which checks the entry point here)
and Ray Train's controller (which unpickles :func:`train_loop_per_worker` by reference to hand it on) never
run one, and each saves that import, about 1.5 s of CPU here, at every job start.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import runpy
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vigil.contract.checkpoint_layout import Location
from vigil.contract.schemas import TRAINING_THREAD, Entrypoint, JobCreate, parse_entrypoint
from vigil.contract.settings import fault_file_path, storage_from_env

if TYPE_CHECKING:
    from vigil import sdk

log = logging.getLogger(__name__)


class EntrypointError(Exception):
    """The entry point cannot be found or loaded (a bad job, not a training failure)."""


def load_function(entry: Entrypoint) -> Callable[..., Any]:
    """The function of a ``module:function`` entry point; :class:`EntrypointError` saying why not."""
    assert entry.module is not None and entry.function is not None
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        raise EntrypointError(f"entrypoint: cannot import {entry.module!r} ({e}); is it in working_dir?") from e
    fn = getattr(module, entry.function, None)
    if not callable(fn):
        raise EntrypointError(f"entrypoint: {entry.module!r} has no function {entry.function!r}")
    return fn


def check_entrypoint(value: str, cwd: Path | None = None) -> Entrypoint:
    """Parse and look up an entry point where it will run (the driver does this before starting ranks).

    A function's module is found and read, not run (:func:`defines`): running it would load the user's
    imports, torch among them, in the driver, a process that never trains (about 2.5 CPU-seconds a job
    here). A module that binds the name in a way reading cannot see is imported after all."""
    entry = parse_entrypoint(value)
    if entry.is_script:
        assert entry.script is not None
        path = (cwd or Path.cwd()) / entry.script
        if not path.is_file():
            raise EntrypointError(f"entrypoint: script {entry.script!r} not found in the working directory {path.parent}")
        return entry
    assert entry.module is not None and entry.function is not None
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError) as e:  # a parent package missing or failing
        raise EntrypointError(f"entrypoint: cannot import {entry.module!r} ({e}); is it in working_dir?") from e
    if spec is None:
        raise EntrypointError(f"entrypoint: cannot import {entry.module!r} (no such module); is it in working_dir?")
    origin = Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    if origin is None or not defines(origin, entry.function):
        load_function(entry)
    return entry


def defines(path: Path, name: str) -> bool:
    """Whether the Python source at ``path`` binds ``name`` at its top level (a ``def``, a class, an
    assignment or an import); :class:`EntrypointError` when it is not valid Python."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError) as e:
        raise EntrypointError(f"entrypoint: cannot read {path.name}: {e}") from e
    return any(name in _bound(node) for node in tree.body)


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds (``def``, class, assignment, import)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def run_entrypoint(entry: Entrypoint, config: dict[str, Any]) -> None:
    """Run the user's code on this rank (inside an open session)."""
    if not entry.is_script:
        load_function(entry)(config)
        return
    assert entry.script is not None
    script = str(Path(entry.script).resolve())
    if not Path(script).is_file():
        raise EntrypointError(f"entrypoint: script {entry.script!r} not found in this rank's working directory "
                              f"{Path.cwd()}")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [entry.script, *entry.args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # a script's sys.exit(0) is success; anything else is a failure
        if e.code not in (None, 0):
            raise RuntimeError(f"script {entry.script} exited with status {e.code}") from e
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def ray_node_name(node_id: str, nodes: list[dict[str, Any]]) -> str:
    """The Ray node *name* of ``node_id`` in ``ray.nodes()``'s answer (Vigil's node identity,
    docs/RECOVERY.md); the node id itself when the node has no name there."""
    for n in nodes:
        if n.get("NodeID") == node_id and n.get("NodeName"):
            return str(n["NodeName"])
    return node_id


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train entry point of each rank. ``config``: ``{"spec": JobCreate as dict, "job_id": str,
    "run_dir": agent sockets dir or None, "checkpoint_root": str (the job's checkpoint root),
    "report_interval": int (optional)}``."""
    import ray
    import ray.train

    # Ray Train runs this function in a thread of the worker process, whose main thread idles in Ray's
    # worker loop: the name lets a py-spy dump of a hung rank be read from the right thread.
    threading.current_thread().name = TRAINING_THREAD
    from vigil import checkpointing as checkpoint
    from vigil import raytrain

    tctx = ray.train.get_context()
    rank = tctx.get_world_rank()
    resume = ray.train.get_checkpoint()  # Ray's pick, before the bridge: a pointer of Vigil's is not verified there
    # The code's own ray.train.report / get_checkpoint go through Vigil's bridge (vigil.raytrain); Vigil's own
    # reports (the rank API's checkpoints) go to Ray Train directly.
    bridge = raytrain.install(str(config["job_id"]), rank, tctx.get_world_size(), session=_open_session)
    ray_report = bridge.inner.report if bridge is not None else ray.train.report

    def report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        # Rank 0 alone hands Ray Train a pointer to the complete checkpoint (module docstring of
        # vigil.checkpointing); Ray copies that tiny folder, never the data.
        if checkpoint_dir is None or rank != 0:
            ray_report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="vigil-pointer-") as d:
            checkpoint.write_pointer(Path(d), checkpoint_dir)
            ray_report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    def preemption_pending() -> bool:
        return ray.train.get_preemption_info() is not None

    with resume.as_directory() if resume is not None else nullcontext(None) as restore_dir:
        summary = run_rank(config, rank, tctx.get_world_size(), report=report, preemption_pending=preemption_pending,
                           restore_dir=Path(restore_dir) if restore_dir is not None else None)
    # Ray Train v2 hands rank 0's return value to the driver (Result.return_value): where the job ended even
    # when it never checkpointed (Result.metrics are only the newest checkpoint's report).
    return final_metrics(summary) if rank == 0 else None


def final_metrics(summary: sdk.TrainSummary) -> dict[str, Any]:
    """Where a rank ended, for the driver's last line: its last step (0: it ran none), the mean of its last
    10 finite losses and its newest validation loss (None where it has none)."""
    losses = [v for _, v in sorted(summary.losses.items()) if v is not None]
    return {
        "step": summary.final_step, "start_step": summary.start_step,
        "loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "val_loss": summary.val_losses[max(summary.val_losses)] if summary.val_losses else None,
    }


def job_files_dir(root: Location) -> Location:
    """The job's folder for the code's own files (``VIGIL_JOB_DIR``), beside its checkpoint root:
    ``<storage>/<slug>/files`` (a URI under a URI storage)."""
    from vigil.contract.checkpoint_layout import join, parent_of

    return join(parent_of(root), "files")


def _open_session() -> Any:
    """The rank's open Vigil session, or None (before the code starts, after it ends)."""
    from vigil import sdk

    s = sdk._current
    return s if s is not None and not s.closed else None


def run_rank(config: dict[str, Any], rank: int, world_size: int, *, report: sdk.ReportFn | None = None,
             preemption_pending: Callable[[], bool] | None = None, restore_dir: Path | None = None,
             live: Any = None) -> sdk.TrainSummary:
    """One rank of the job under Ray (Ray Train's worker, or a live replica's actor): its context (node,
    agent socket, fault file, checkpoint root), then the job's entry point in a session."""
    import ray

    from vigil import checkpointing as checkpoint
    from vigil import sdk
    from vigil.contract.settings import agent_socket_path, get_settings
    from vigil.telemetry import RankTelemetry

    spec = JobCreate.model_validate(config["spec"])
    entry = parse_entrypoint(spec.entrypoint)
    job_id = str(config["job_id"])
    ray_node_id = ray.get_runtime_context().get_node_id()
    try:
        node = ray_node_name(ray_node_id, ray.nodes())
    except Exception as e:  # noqa: BLE001 - the node id still identifies the node, only less durably
        log.warning("rank %d: cannot read Ray's node names (%s); using the node id", rank, e)
        node = ray_node_id
    run_dir = Path(config.get("run_dir") or get_settings().run_dir)
    root = checkpoint.as_location(config.get("checkpoint_root") or checkpoint.job_root(storage_from_env(), job_id))
    extra: dict[str, Any] = {}
    if report is not None:
        extra["report"] = report
    if preemption_pending is not None:
        extra["preemption_pending"] = preemption_pending
    from vigil.launch import JOB_DIR_ENV

    # The code's own files, every rank, every start (a URI when the storage is one: docs/DEPLOY.md).
    os.environ[JOB_DIR_ENV] = str(job_files_dir(root))
    if entry.is_script and live is None:
        return run_script_rank(config, spec, entry, rank, world_size, node=node, run_dir=run_dir, root=root,
                               restore_dir=restore_dir, report=report)
    with RankTelemetry(agent_socket_path(run_dir, node)) as telemetry:
        ctx = sdk.RankContext(
            rank=rank,
            world_size=world_size,
            job_id=job_id,
            node_id=node,
            telemetry=telemetry,
            checkpoint_root=root,
            restore_dir=restore_dir,
            report_interval=int(config.get("report_interval") or sdk.REPORT_INTERVAL_STEPS),
            fault_file=fault_file_path(run_dir, job_id, rank),
            live=live,
            **extra,
        )
        summary = sdk.run(lambda cfg: run_entrypoint(entry, cfg), ctx, spec)
        if telemetry.dropped_total:
            log.info("rank %d: %d telemetry samples dropped (no agent or agent busy)", ctx.rank, telemetry.dropped_total)
    log.info("rank %d (node %s) finished at step %d", ctx.rank, node, summary.final_step)
    return summary


def run_script_rank(config: dict[str, Any], spec: JobCreate, entry: Entrypoint, rank: int, world_size: int, *,
                    node: str, run_dir: Path, root: Location, restore_dir: Path | None,
                    report: sdk.ReportFn | None) -> sdk.TrainSummary:
    """A script entry point on this rank: a child process with torchrun's environment (:mod:`vigil.launch`).
    Rank 0 picks the children's rendezvous port on its node and tells the others through the process group
    Ray Train made (which the children do not use: they make their own, as under torchrun)."""
    import ray.train
    import torch.distributed as dist

    from vigil import launch, sdk
    from vigil.contract.settings import agent_socket_path

    assert entry.script is not None
    tctx = ray.train.get_context()
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    box = [launch.free_port(master) if rank == 0 else 0]
    if world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    job_id = str(config["job_id"])
    folder = Path(tempfile.mkdtemp(prefix=f"vigil-rank{rank}-"))
    context = launch.write_context(
        folder / "context.json", job_id=job_id, node_id=node, socket_path=str(agent_socket_path(run_dir, node)),
        fault_file=str(fault_file_path(run_dir, job_id, rank)), checkpoint_root=str(root),
        restore_dir=str(restore_dir) if restore_dir is not None else None,
        report_interval=int(config.get("report_interval") or sdk.REPORT_INTERVAL_STEPS),
        spec=spec.model_dump(mode="json"), config=dict(spec.config))
    done = launch.run_script(entry.script, entry.args, rank=rank, world_size=world_size,
                             local_rank=tctx.get_local_rank(), local_world_size=tctx.get_local_world_size(),
                             master_addr=master, master_port=int(box[0]), context_file=context,
                             job_dir=job_files_dir(root))
    summary = sdk.TrainSummary(final_step=int(done.get("step") or 0), checkpoints=list(done.get("checkpoints") or []))
    if report is not None:  # every rank, once: Ray Train's result holds the script's last step
        report({"step": summary.final_step, "loss": done.get("loss"), "world_size": world_size}, None)
    log.info("rank %d (node %s) script finished at step %d", rank, node, summary.final_step)
    return summary
