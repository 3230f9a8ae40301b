"""The driver's edge: arguments and environment to a validated config, and the Ray Train objects it
builds from it. Imports Ray Train but starts no cluster (the run itself is in test_ray_integration).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vigil.contract.schemas import JobCreate
from vigil.driver import (
    RAY_TRAIN_ENV_DEFAULTS,
    DriverConfig,
    UsageError,
    build_trainer,
    main,
    parse_config,
    ray_train_env,
    result_metrics,
    without_idle_datasets_callback,
)

SPEC = JobCreate(name="drv", scaling={"min_workers": 2, "max_workers": 4, "cpus_per_worker": 0.5},
                 recovery={"max_restarts": 5}, checkpoint={"interval_steps": 10, "keep_last": 2})


def test_config_from_environment(tmp_path: Path) -> None:
    env = {"VIGIL_JOB_ID": "j1", "VIGIL_JOB_SPEC": SPEC.model_dump_json(), "VIGIL_RUN_DIR": "/tmp/vr",
           "VIGIL_STORAGE_PATH": str(tmp_path)}
    cfg = parse_config([], env)
    assert cfg == DriverConfig(job_id="j1", spec=SPEC, run_dir="/tmp/vr", storage_path=str(tmp_path.resolve()))


def test_flags_win_over_environment_and_yaml_is_accepted(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: from-file\nsteps: 7\nscaling: {min_workers: 1, max_workers: 1}\n")
    env = {"VIGIL_JOB_ID": "env-id", "VIGIL_JOB_SPEC": SPEC.model_dump_json()}
    cfg = parse_config(["--job-id", "flag-id", "--spec-file", str(spec_file), "--report-interval", "3"], env)
    assert (cfg.job_id, cfg.spec.name, cfg.spec.steps, cfg.report_interval) == ("flag-id", "from-file", 7, 3)
    assert cfg.storage_path == str(Path("~/.vigil-storage").expanduser().resolve())
    assert cfg.run_dir is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"VIGIL_JOB_SPEC": "{}"}, "no job id"),
        ([], {"VIGIL_JOB_ID": "j"}, "no job spec"),
        ([], {"VIGIL_JOB_ID": "j", "VIGIL_JOB_SPEC": json.dumps({"name": "x", "steps": 0})}, "steps"),
        ([], {"VIGIL_JOB_ID": "j", "VIGIL_JOB_SPEC": json.dumps({"name": "x", "bogus": 1})}, "bogus"),
        ([], {"VIGIL_JOB_ID": "j", "VIGIL_JOB_SPEC": "name: [unclosed"}, "neither JSON nor YAML"),
        (["--spec-file", "/nonexistent/spec.json"], {"VIGIL_JOB_ID": "j"}, "cannot read"),
        ([], {"VIGIL_JOB_ID": "j" * 65, "VIGIL_JOB_SPEC": "{}"}, "not usable in telemetry"),
    ],
)
def test_unusable_input_is_a_usage_error_naming_the_problem(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_config(argv, env)


def test_main_exits_2_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VIGIL_JOB_ID", "j")
    monkeypatch.setenv("VIGIL_JOB_SPEC", json.dumps({"name": "x", "batch_size": -1}))
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "invalid job spec" in err and "batch_size" in err


def test_trainer_is_built_from_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vigil.ray_backend import RankGroupConfig
    from vigil.runner import train_loop_per_worker

    for name in ray_train_env(1):  # build_trainer sets them; restored after the test
        monkeypatch.delenv(name, raising=False)
    cfg = DriverConfig(job_id="j9", spec=SPEC, run_dir="/tmp/vr", storage_path=str(tmp_path), report_interval=4)
    t = build_trainer(cfg)
    sc = t.scaling_config
    assert sc.num_workers == (2, 4)  # elastic between min and max
    assert sc.resources_per_worker == {"CPU": 0.5} and not sc.use_gpu
    rc = t.run_config
    assert (rc.name, rc.storage_path) == ("vigil-j9", str(tmp_path))
    assert rc.failure_config.max_failures == 5
    assert rc.checkpoint_config.num_to_keep == 2
    assert isinstance(t.backend_config, RankGroupConfig) and t.backend_config.backend == "gloo"
    assert t.train_loop_per_worker is train_loop_per_worker
    loop_cfg = t.train_loop_config
    assert JobCreate.model_validate(loop_cfg["spec"]) == SPEC
    assert (loop_cfg["job_id"], loop_cfg["run_dir"], loop_cfg["report_interval"]) == ("j9", "/tmp/vr", 4)
    assert loop_cfg["checkpoint_root"] == str(tmp_path / "j9" / "checkpoints")

    # No Ray Datasets in a Vigil job: no DatasetManager actor at each start of the worker group; the rest kept.
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    ours = t._create_default_callbacks()
    assert not [c for c in ours if isinstance(c, DatasetsCallback)]
    theirs = DataParallelTrainer._create_default_callbacks(t)
    assert [type(c) for c in theirs if not isinstance(c, DatasetsCallback)] == [type(c) for c in ours]
    assert [c for c in theirs if isinstance(c, DatasetsCallback)]  # what Ray itself would start
    assert without_idle_datasets_callback(theirs, {"train": object()}) == theirs  # a run with datasets: unchanged

    fixed = build_trainer(DriverConfig(job_id="j", spec=SPEC.model_copy(update={"scaling": SPEC.scaling.model_copy(
        update={"min_workers": 3, "max_workers": 3})}), run_dir=None, storage_path=str(tmp_path)))
    assert fixed.scaling_config.num_workers == 3


def test_main_exits_1_when_training_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vigil import driver

    def failing_run(cfg: DriverConfig) -> dict[str, object]:
        raise RuntimeError("worker group died")

    monkeypatch.setattr(driver, "run", failing_run)
    monkeypatch.setenv("VIGIL_JOB_SPEC", SPEC.model_dump_json())
    assert main(["--job-id", "j"]) == 1
    err = capsys.readouterr().err
    assert "job j FAILED: RuntimeError: worker group died" in err


def test_ray_train_timeouts_are_set_unless_the_environment_has_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    for name in ray_train_env(1):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "42")
    t = build_trainer(DriverConfig(job_id="a/../b", spec=SPEC, run_dir=None, storage_path=str(tmp_path)))
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "42"  # the operator's value wins
    assert os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] == "1"
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"  # SPEC: at most 4 ranks
    assert RAY_TRAIN_ENV_DEFAULTS["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "15"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    build_trainer(DriverConfig(job_id="c", spec=SPEC, run_dir=None, storage_path=str(tmp_path)))
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"  # the operator's value wins here too
    # Paths from a job id are slugged: no traversal out of the storage path.
    assert "/" not in t.run_config.name and ".." not in t.run_config.name
    root = Path(t.train_loop_config["checkpoint_root"])
    assert root.parent.parent == tmp_path and ".." not in root.parts


def test_ray_train_polls_small_jobs_8x_as_often_as_ray_and_never_more_than_256_ranks_per_second() -> None:
    """Ray Train's 2 s poll is also how often a rank may report (one unread report per rank): a small job
    is polled every 0.25 s; the poll slows with the job so the controller makes at most 256 rank polls
    per second, and is never slower than Ray's own 2 s."""
    from vigil.driver import health_check_interval_s

    assert [health_check_interval_s(n) for n in (0, 1, 2, 64)] == [0.25] * 4
    assert health_check_interval_s(128) == 0.5 and health_check_interval_s(256) == 1.0
    assert [health_check_interval_s(n) for n in (512, 4096)] == [2.0, 2.0]
    for n in (1, 2, 16, 64, 100, 256, 300, 511, 512, 10_000):
        assert n / health_check_interval_s(n) <= 256 or health_check_interval_s(n) == 2.0
    assert ray_train_env(8)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
    assert ray_train_env(300)["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1.17188"


def test_a_failed_run_that_progressed_is_run_again_one_without_progress_fails() -> None:
    """Ray Train's failure budget covers every failure of a run; the job fails only when a run's
    restarts made no progress (the newest valid checkpoint did not move)."""
    from vigil.driver import fit_while_progressing

    checkpoint = {"step": 10}
    outcomes = [40, 70, None]  # two runs fail after checkpointing further, the third succeeds
    calls: list[int] = []

    def fit() -> str:
        calls.append(checkpoint["step"])
        reached = outcomes.pop(0)
        if reached is None:
            return "done"
        checkpoint["step"] = reached
        raise RuntimeError("max failures reached")

    assert fit_while_progressing(fit, lambda: checkpoint["step"]) == "done"
    assert calls == [10, 40, 70]  # each fresh run starts from the newest checkpoint

    def stuck() -> str:
        calls.append(-1)
        raise RuntimeError("TrainingFailedError: crashes at every restart")

    calls.clear()
    with pytest.raises(RuntimeError, match="crashes at every restart"):
        fit_while_progressing(stuck, lambda: checkpoint["step"])
    assert calls == [-1]  # no progress: not run again

    outcomes[:] = [90, None]  # max_restarts 0: a failure is final, progress or not
    calls.clear()
    with pytest.raises(RuntimeError, match="max failures reached"):
        fit_while_progressing(fit, lambda: checkpoint["step"], again=False)
    assert calls == [70]


def test_newest_valid_step_reads_the_job_checkpoint_root(tmp_path: Path) -> None:
    from vigil.driver import newest_valid_step

    assert newest_valid_step(tmp_path / "missing") == -1
    assert newest_valid_step(tmp_path) == -1


# -- max_restarts and progress: the one definition (vigil/contract/restarts.py) --------------------------------


def test_progress_is_the_resume_point_moving_forward() -> None:
    from vigil.contract.restarts import progressed

    assert progressed(None, -1)  # the first restart: the job's start is the mark
    assert progressed(10, 20) and not progressed(20, 20) and not progressed(20, 10)


@pytest.mark.parametrize(("max_restarts", "limit", "reruns"), [(0, 1, False), (1, 1, True), (3, 3, True)])
def test_the_restart_budget_counts_restarts_in_a_row_without_progress(max_restarts: int, limit: int,
                                                                       reruns: bool) -> None:
    from vigil.contract.restarts import RestartBudget

    budget = RestartBudget(max_restarts)
    assert budget.limit == limit and budget.reruns == reruns
    assert budget.ray_train_max_failures == max_restarts  # the driver hands Ray Train the same number
    stalled, mark = 0, None
    for point in (10, 10, 20, 20, 20):  # where each restart resumed from
        stalled, mark = budget.after_restart(stalled, mark, point), point
    assert stalled == 2  # the last two resumed from 20 again: no progress since the one before
    assert budget.exhausted(stalled) == (stalled >= limit)


def test_the_driver_hands_max_restarts_to_ray_train_and_reruns_only_with_restarts_asked_for(tmp_path: Path) -> None:
    for n in (0, 4):
        spec = SPEC.model_copy(update={"recovery": SPEC.recovery.model_copy(update={"max_restarts": n})})
        t = build_trainer(DriverConfig(job_id="j", spec=spec, run_dir=None, storage_path=str(tmp_path)))
        assert t.run_config.failure_config.max_failures == n


def test_the_final_metrics_are_where_rank_0_ended_not_the_newest_checkpoint() -> None:
    # Ray Train v2's Result.metrics are the newest checkpoint's report; rank 0's return value says where it
    # ended (vigil.runner.final_metrics). A job that never checkpointed had step=None in its last line.
    assert result_metrics({}, {"step": 40, "start_step": 1, "loss": 2.5, "val_loss": None}, None) == {
        "step": 40, "start_step": 1, "loss": 2.5, "checkpoint": None}
    reported = {"step": 30, "loss": 3.0, "val_loss": 3.1, "checkpoint_path": "/s/j/step_30"}
    got = result_metrics(reported, {"step": 35, "start_step": 31, "loss": 2.9, "val_loss": None}, "/ray/ptr")
    assert (got["step"], got["loss"], got["val_loss"], got["checkpoint"]) == (35, 2.9, 3.1, "/s/j/step_30")
    # A run whose rank 0 returned nothing (an older job's code path): the checkpoint's report as before.
    assert result_metrics(reported, None, "/ray/ptr")["step"] == 30
    assert result_metrics(None, None, "/ray/ptr") == {"checkpoint": "/ray/ptr"}
    # Rank 0 restored at the last step ran none (step 0): the checkpoint's report stands, not step 0.
    assert result_metrics(reported, {"step": 0, "start_step": 1, "loss": None, "val_loss": None}, None)["step"] == 30


def test_final_metrics_of_a_rank_summary() -> None:
    from vigil.rank.context import TrainSummary
    from vigil.runner import final_metrics

    summary = TrainSummary(start_step=3, final_step=14, losses={s: float(s) for s in range(3, 15)} | {9: None},
                           val_losses={5: 1.5, 10: 1.25})
    # the last 10 finite losses: steps 4-14 without 9 (not finite), mean 9.0; the newest validation loss
    assert final_metrics(summary) == {"step": 14, "start_step": 3, "loss": 9.0, "val_loss": 1.25}
    assert final_metrics(TrainSummary())["loss"] is None
