"""The Ray job driver: validate the job spec and its entry point, then run it on every rank with Ray Train v2.

Runs as the entrypoint of a Ray job (``python -m vigil``) on an existing cluster: ``ray.init()``
with no address joins it (``RAY_ADDRESS`` is set by the job runner; token auth, on by default in
Ray 2.60, is picked up by ``ray.init`` itself). Inputs, in order of precedence:

- ``--job-id ID``, else env ``VIGIL_JOB_ID``;
- ``--spec-file PATH`` (JSON or YAML), else env ``VIGIL_JOB_SPEC`` (JSON);
- env ``VIGIL_RUN_DIR``: node-local folder of the agents' sockets (default from settings);
- env ``VIGIL_STORAGE_PATH``: where checkpoints live (default ``~/.vigil-storage``): Vigil's
  checkpoint root of the job, ``<storage>/<slug(job id)>/checkpoints`` (see
  :mod:`vigil.checkpointing`), and Ray Train's run folder ``<storage>/vigil-<slug(job id)>``, which
  holds pointers to them. Multi-node runs need a path every node sees (on one machine any local
  path is shared), or a URI of an object store, ``s3://bucket/prefix`` (endpoint and credentials
  from the standard ``AWS_*`` variables; Ray Train reads the same URI through pyarrow).

The Ray Train run is named ``vigil-<slug(job id)>``: a resubmitted job with the same id resumes
from the newest valid checkpoint of its root (or the one Ray Train recorded, when newer).

Recovery settings handed to Ray Train: ``recovery.max_restarts`` and "progress" mean what
:mod:`vigil.contract.restarts` says (its one definition; the controller applies the same one). The driver
hands the number to Ray Train unchanged, as ``FailureConfig.max_failures`` (preemptions, i.e. Vigil's own
evictions, are counted apart by Ray Train and not limited here: the controller bounds restarts without
progress). Ray Train counts every failure of a run, progress or not, so a long job hit by more faults than
that, days apart, would fail; the driver therefore starts a fresh Ray Train run (from the newest valid
checkpoint) when a run fails *after* its newest valid checkpoint moved forward (progress:
:func:`vigil.contract.restarts.progressed`), and gives up only when a run's ``max_restarts`` restarts made no
progress (:func:`fit_while_progressing`). The environment gets, unless already set,
``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=15`` (Ray's default of 60 s is mostly spent waiting for
workers that an eviction made impossible before the group restarts smaller) and
``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=1`` (how soon ranks learn of a drain; Ray's default is 5 s) and
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` from 0.25 s up to Ray's 2 s with the job's size
(:func:`health_check_interval_s`: how soon Ray Train sees a rank die or finish, and how often a rank
may report); Ray Train hands them to its controller and workers.

Exit status: 0 on success, 2 for a bad spec or arguments, 1 when training failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vigil.contract.checkpoint_layout import Location, as_location, join
from vigil.contract.restarts import RestartBudget, progressed
from vigil.contract.schemas import JobCreate, RecoveryPolicy, slugify
from vigil.contract.settings import ENV_JOB_ID, ENV_JOB_SPEC, ENV_RUN_DIR, storage_from_env

log = logging.getLogger(__name__)

RAY_TRAIN_ENV_DEFAULTS: dict[str, str] = {
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
}
"""Ray Train settings the driver sets unless the environment already has them (module docstring)."""

HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""How often Ray Train's controller polls every rank (:func:`health_check_interval_s`)."""
RAY_HEALTH_CHECK_S = 2.0
"""Ray Train's own default for :data:`HEALTH_CHECK_ENV`."""
MIN_HEALTH_CHECK_S = 0.25
MAX_RANK_POLLS_PER_S = 256.0


def health_check_interval_s(workers: int) -> float:
    """Seconds between two polls of the ranks by Ray Train's controller, for a job of ``workers`` ranks.

    The poll is how Ray Train learns that a rank died or finished, and how it takes each rank's
    ``report``: a rank holds one unread report at most, so a rank reporting again before the next poll
    waits for it (with Ray's 2 s, a job checkpointing every 0.2 s of training trains at one checkpoint
    per 2 s). The driver polls as often as every 0.25 s, for at most 256 rank polls per second: each
    is one small actor call, and the controller is one process. From 512 ranks on, Ray's own 2 s.
    """
    return min(RAY_HEALTH_CHECK_S, max(MIN_HEALTH_CHECK_S, max(1, workers) / MAX_RANK_POLLS_PER_S))


def ray_train_env(workers: int) -> dict[str, str]:
    """The Ray Train settings the driver sets unless set (:data:`RAY_TRAIN_ENV_DEFAULTS` and the poll)."""
    return {**RAY_TRAIN_ENV_DEFAULTS, HEALTH_CHECK_ENV: f"{health_check_interval_s(workers):g}"}


class UsageError(Exception):
    """Bad arguments or spec: exit status 2 with the message."""


@dataclass(frozen=True)
class DriverConfig:
    """Everything the driver needs, validated."""

    job_id: str
    spec: JobCreate
    run_dir: str | None
    storage_path: str
    """A resolved local folder, or a URI (``s3://bucket/prefix``)."""
    report_interval: int | None = None


def _read_spec(text: str, source: str) -> JobCreate:
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml

            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UsageError(f"{source}: neither JSON nor YAML ({e})") from e
    try:
        return JobCreate.model_validate(raw)
    except ValidationError as e:
        raise UsageError(f"{source}: invalid job spec:\n{e}") from e


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> DriverConfig:
    """Arguments and environment to a :class:`DriverConfig`; :class:`UsageError` when unusable."""
    env = dict(os.environ) if env is None else env
    p = argparse.ArgumentParser(prog="python -m vigil", description="Run a Vigil training job on Ray Train.")
    p.add_argument("--job-id", help=f"Vigil job id (default: ${ENV_JOB_ID})")
    p.add_argument("--spec-file", type=Path, help=f"job spec, JSON or YAML (default: ${ENV_JOB_SPEC} as JSON)")
    p.add_argument("--report-interval", type=int, default=None, help="steps between Ray Train reports")
    args = p.parse_args(argv)

    job_id = args.job_id or env.get(ENV_JOB_ID)
    if not job_id:
        raise UsageError(f"no job id: pass --job-id or set {ENV_JOB_ID}")
    from vigil.telemetry import check_job_id

    try:
        check_job_id(job_id)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if args.spec_file is not None:
        try:
            spec = _read_spec(args.spec_file.read_text(), str(args.spec_file))
        except OSError as e:
            raise UsageError(f"cannot read spec file: {e}") from e
    elif env.get(ENV_JOB_SPEC):
        spec = _read_spec(env[ENV_JOB_SPEC], f"${ENV_JOB_SPEC}")
    else:
        raise UsageError(f"no job spec: pass --spec-file or set {ENV_JOB_SPEC}")
    from vigil.runner import EntrypointError, check_entrypoint

    try:  # here, where the job's code is (its working_dir is this process's working directory)
        check_entrypoint(spec.entrypoint)
    except (EntrypointError, ValueError) as e:
        raise UsageError(str(e)) from e
    if args.report_interval is not None and args.report_interval < 1:
        raise UsageError("--report-interval must be >= 1")
    try:
        storage = str(storage_from_env(env))
    except ValueError as e:  # a URI with '..' or an empty segment
        raise UsageError(f"checkpoint storage: {e}") from e
    return DriverConfig(
        job_id=job_id, spec=spec, run_dir=env.get(ENV_RUN_DIR) or None, storage_path=storage,
        report_interval=args.report_interval,
    )


def rank_config(cfg: DriverConfig) -> dict[str, Any]:
    """What every rank is handed (:func:`vigil.runner.run_rank`)."""
    from vigil.checkpointing import job_root

    return {
        "spec": cfg.spec.model_dump(mode="json"),
        "job_id": cfg.job_id,
        "run_dir": cfg.run_dir,
        "checkpoint_root": str(job_root(cfg.storage_path, cfg.job_id)),
        "report_interval": cfg.report_interval,
    }


def build_trainer(cfg: DriverConfig) -> Any:
    """The Ray Train trainer for ``cfg`` (needs ``ray.init`` before ``fit``)."""
    # Ray Train v2 is chosen when ray.train is first imported; set the switch before that.
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # Read by Ray Train's controller and workers: fit() hands the driver's values to both.
    for name, value in ray_train_env(cfg.spec.scaling.max_workers).items():
        os.environ.setdefault(name, value)
    # The v2 classes by their own modules: ``ray.train`` and ``ray.train.torch`` re-export them only
    # when v2 is on, which type checkers cannot see (and which a stray RAY_TRAIN_V2_ENABLED=0 would flip).
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from vigil.contract.settings import ENV_FR_BUFFER, FR_BUFFER_DEFAULT
    from vigil.ray_backend import RankGroupConfig
    from vigil.runner import train_loop_per_worker

    sc = cfg.spec.scaling
    num_workers: int | tuple[int, int] = (
        (sc.min_workers, sc.max_workers) if sc.min_workers != sc.max_workers else sc.max_workers
    )
    budget = RestartBudget(cfg.spec.recovery.max_restarts)

    class Trainer(DataParallelTrainer):  # type: ignore[misc]
        """Ray's ``TorchTrainer``, less two costs: no torch import in the driver and Ray Train's controller
        (:mod:`vigil.ray_backend`), no actor for Ray Datasets that no Vigil job passes."""

        def _create_default_callbacks(self) -> list[Any]:
            return without_idle_datasets_callback(super()._create_default_callbacks(), self.datasets)

    return Trainer(
        train_loop_per_worker,
        train_loop_config=rank_config(cfg),
        backend_config=RankGroupConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=num_workers, resources_per_worker={"CPU": sc.cpus_per_worker}, use_gpu=False
        ),
        run_config=RunConfig(
            name=run_name(cfg.job_id),
            storage_path=cfg.storage_path,
            failure_config=FailureConfig(max_failures=budget.ray_train_max_failures),  # the same number
            # Ray keeps pointers only (vigil.checkpointing); Vigil's own retention keeps the data.
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.spec.checkpoint.keep_last),
            # Ranks are single-threaded by design (many ranks share a machine's cores).
            # The Flight Recorder records every collective of the user's code (vigil.capture): sized
            # before Ray Train makes the process group.
            worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                             ENV_FR_BUFFER: os.environ.get(ENV_FR_BUFFER, str(FR_BUFFER_DEFAULT))}},
        ),
    )


def without_idle_datasets_callback(callbacks: list[Any], datasets: dict[str, Any] | None) -> list[Any]:
    """Ray Train's callbacks less its ``DatasetsCallback`` when the run has no Ray Datasets.

    Ray Train 2.60 starts a ``DatasetManager`` actor (a process of its own, about 3.5 CPU-seconds to start
    here) at every start of the worker group, the first and each restart, datasets or none. Its ranks get no
    dataset shard provider instead, the value Ray's worker takes by default. ``datasets`` given: unchanged.
    """
    if datasets:
        return callbacks
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    return [c for c in callbacks if not isinstance(c, DatasetsCallback)]


def run(cfg: DriverConfig) -> dict[str, Any]:
    """Connect to Ray, train, and return the final metrics of rank 0. Raises on training failure."""
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    if not ray.is_initialized():
        ray.init()
    log.info(
        "job %s: %s on %s-%s workers, %d steps, storage %s", cfg.job_id, cfg.spec.optimizer.kind,
        cfg.spec.scaling.min_workers, cfg.spec.scaling.max_workers, cfg.spec.steps, cfg.storage_path,
    )
    from vigil.checkpointing import job_root

    if cfg.spec.recovery.policy == RecoveryPolicy.LIVE:
        from vigil.live_driver import run_live

        sc = cfg.spec.scaling
        return run_live(rank_config(cfg), replicas=sc.max_workers, min_replicas=sc.min_workers,
                        cpus_per_replica=sc.cpus_per_worker)
    root = job_root(cfg.storage_path, cfg.job_id)
    run_folder = join(as_location(cfg.storage_path), run_name(cfg.job_id))
    result = fit_while_progressing(lambda: build_trainer(cfg).fit(), lambda: newest_valid_step(root, run_folder),
                                   cfg.job_id, again=RestartBudget(cfg.spec.recovery.max_restarts).reruns)
    return result_metrics(result.metrics, getattr(result, "return_value", None),
                          result.checkpoint.path if result.checkpoint is not None else None)


def result_metrics(reported: dict[str, Any] | None, returned: Any, checkpoint_path: str | None) -> dict[str, Any]:
    """The run's final metrics from Ray Train's result: the newest checkpoint's report (``reported``),
    overlaid by what rank 0 returned where it ended (``returned``, :func:`vigil.runner.final_metrics`: its
    last step, also for a job that never checkpointed or trained past its newest checkpoint); the
    checkpoint named by its folder (Ray's checkpoint is a pointer, :mod:`vigil.checkpointing`). A rank 0 that
    ran no step (restored at the last step) returns step 0: the report stands."""
    metrics = dict(reported or {})
    if isinstance(returned, dict) and returned.get("step"):  # step 0: rank 0 ran no step (restored at the end)
        metrics.update({k: v for k, v in returned.items() if v is not None})
    metrics["checkpoint"] = metrics.get("checkpoint_path") or checkpoint_path
    return metrics


def run_name(job_id: str) -> str:
    """Ray Train's run name of a job (a folder under the storage path: never raw input)."""
    return f"vigil-{slugify(job_id)}"


def newest_valid_step(root: Location, run_folder: Location | None = None) -> int:
    """The step of the newest valid checkpoint under ``root`` (-1: none), or of the code's own Ray Train
    checkpoints in ``run_folder`` (their manifests: :mod:`vigil.raytrain`) when newer."""
    from vigil.checkpointing import choose
    from vigil.raytrain import newest_step

    manifest, _ = choose(root)  # a root not made yet holds none
    own = newest_step(run_folder) if run_folder is not None else -1
    return max(manifest.step if manifest is not None else -1, own)


def fit_while_progressing(fit: Callable[[], Any], progress: Callable[[], int], job_id: str = "", *,
                          again: bool = True) -> Any:
    """``fit()`` (one Ray Train run, with its own failure budget) until it succeeds; after a failed
    run, again from the newest valid checkpoint if that moved forward during the run (``progress()``,
    a step; :func:`~vigil.contract.restarts.progressed`), else re-raise: its restarts made no progress.
    ``again=False`` (``max_restarts: 0``, no restarts asked for: ``RestartBudget.reruns``): the first failure
    is final."""
    runs = 0
    while True:
        start = progress() if again else 0
        runs += 1
        try:
            return fit()
        except Exception as e:
            reached = progress() if again else 0
            if not progressed(start, reached):
                raise
            log.warning("job %s: Ray Train run %d failed (%s) after progress (checkpoint step %d -> %d): "
                        "starting a fresh run from step %d", job_id, runs, type(e).__name__, start, reached,
                        reached)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m vigil``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_config(argv)
    except UsageError as e:
        print(f"vigil trainer: {e}", file=sys.stderr)
        return 2
    try:
        metrics = run(cfg)
    except Exception as e:  # the driver's job is to turn any failure into a clear exit status
        log.exception("job %s failed", cfg.job_id)
        print(f"vigil trainer: job {cfg.job_id} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        f"vigil trainer: job {cfg.job_id} SUCCEEDED step={metrics.get('step')} loss={metrics.get('loss')} "
        f"val_loss={metrics.get('val_loss')} checkpoint={metrics.get('checkpoint')}"
    )
    return 0
