"""Telemetry bound to its job (controller/telemetry_guard.py).

Before: the controller stored any sample whose ``job_id`` existed, from any node's agent: a rank of job A sent
NaN losses or a "checkpoint" for job B through its own agent, and Vigil restarted B (or restored it from the
attacker's folder). Now a node speaks for a job only where Ray placed one of the job's processes, and a job's
checkpoints are recorded only inside its own storage. A real controller over HTTP; Ray's placement is the seam
(a stand-in function), the rest is the production path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select, update

from controller.db import session_scope
from controller.models import Checkpoint, Job, StepMetric
from controller.telemetry_guard import REFUSED, TelemetryGuard
from tests.live_controller import LiveController, step_sample
from vigil.contract.checkpoint_layout import job_checkpoint_root
from vigil.contract.schemas import CheckpointSample, StepSample

RAY_NODES = {"vigil-node-1", "vigil-node-2", "vigil-node-3"}


class StandInRay:
    """Where Ray placed each launch's processes (None: Ray's API did not answer)."""

    def __init__(self) -> None:
        self.placed: dict[str, set[str]] = {}
        self.down = False
        self.asked = 0

    def __call__(self, launch_id: str) -> tuple[set[str], set[str]] | None:
        self.asked += 1
        return None if self.down else (self.placed.get(launch_id, set()), RAY_NODES)


@pytest.fixture
def ray() -> StandInRay:
    return StandInRay()


@pytest.fixture
def ctl(tmp_path: Path, ray: StandInRay):
    def guard(app, _url) -> None:  # type: ignore[no-untyped-def]
        app.state.telemetry_guard = TelemetryGuard(str(app.state.telemetry_guard.storage), ray, min_refresh_s=0.0)

    c = LiveController(tmp_path / "controller", extend=guard).start()
    try:
        yield c
    finally:
        c.stop()


def launched(ctl: LiveController, name: str) -> str:
    job = ctl.submit_job(name)
    with session_scope(ctl.app.state.sessions) as s:
        s.execute(update(Job).where(Job.id == job.id).values(ray_job_id=f"vigil-{job.id}"))
    return job.id


def steps_of(ctl: LiveController, job_id: str) -> int:
    ctl.settle()
    with session_scope(ctl.app.state.sessions) as s:
        return int(s.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job_id)) or 0)


def refused(reason: str) -> float:
    return REFUSED.labels(reason)._value.get()


def test_samples_for_a_job_from_a_node_that_never_ran_it_are_refused_counted_and_never_stored(
    ctl: LiveController, ray: StandInRay
) -> None:
    victim, attacker = launched(ctl, "victim"), launched(ctl, "attacker")
    ray.placed = {f"vigil-{victim}": {"vigil-node-1"}, f"vigil-{attacker}": {"vigil-node-2"}}
    before = refused("node")
    nan = [step_sample(victim, 0, s, loss=None) for s in range(1, 6)]
    ctl.post_batch("vigil-node-2", nan + [step_sample(attacker, 0, 1)])  # the attacker's node speaks for the victim
    assert steps_of(ctl, victim) == 0 and steps_of(ctl, attacker) == 1  # its own samples still count
    assert refused("node") - before == 5
    (event,) = ctl.events(victim, kind="telemetry_refused")
    assert event.node_id == "vigil-node-2" and event.data == {"reason": "node", "samples": 5}
    ctl.post_batch("vigil-node-1", [step_sample(victim, 0, 1)])  # where the victim runs: kept
    assert steps_of(ctl, victim) == 1


def test_a_node_the_job_moved_to_is_asked_about_again_and_one_it_left_may_still_send(
    ctl: LiveController, ray: StandInRay
) -> None:
    job = launched(ctl, "moving")
    ray.placed = {f"vigil-{job}": {"vigil-node-1"}}
    ctl.post_batch("vigil-node-1", [step_sample(job, 0, 1)])
    ray.placed = {f"vigil-{job}": {"vigil-node-3"}}  # restarted elsewhere (Ray also lists the dead actors: kept)
    ctl.post_batch("vigil-node-3", [step_sample(job, 0, 2)])
    ctl.post_batch("vigil-node-1", [step_sample(job, 1, 2)])  # spooled samples of the node it left
    assert steps_of(ctl, job) == 3


def test_without_an_answer_from_ray_or_for_an_unnamed_node_nothing_is_lost(ctl: LiveController, ray: StandInRay
                                                                             ) -> None:
    job = launched(ctl, "ray-down")
    ray.down = True
    ctl.post_batch("vigil-node-2", [step_sample(job, 0, 1)])
    ray.down = False
    ctl.post_batch("laptop-agent", [step_sample(job, 0, 2)])  # an agent not named after a Ray node
    assert steps_of(ctl, job) == 2


def test_a_checkpoint_outside_the_jobs_own_storage_is_refused(ctl: LiveController, ray: StandInRay) -> None:
    job, other = launched(ctl, "ckpt"), launched(ctl, "other")
    ray.placed = {f"vigil-{job}": {"vigil-node-1"}}
    storage = Path(ctl.app.state.telemetry_guard.storage)
    mine = job_checkpoint_root(storage, job) / "step-5"
    outside = [str(job_checkpoint_root(storage, other) / "step-5"), "/etc/step-5",
               f"{job_checkpoint_root(storage, job)}/../../{other}/checkpoints/step-5", str(storage) + "-x/" + job]
    before = refused("checkpoint_path")
    ctl.post_batch("vigil-node-1", [CheckpointSample(job_id=job, step=5, ts=1.0, path=p) for p in [*outside, str(mine)]])
    with session_scope(ctl.app.state.sessions) as s:
        assert s.scalars(select(Checkpoint.path).where(Checkpoint.job_id == job)).all() == [str(mine)]
    assert refused("checkpoint_path") - before == len(outside)


@pytest.mark.parametrize(("path", "ok"), [
    ("/s/job-1/checkpoints/step-3", True), ("/s/vigil-job-1/checkpoint_0001", True), ("/s/job-1/files/x", True),
    ("/s/job-2/checkpoints/step-3", False), ("/s/job-1", False), ("/s/job-1/../job-2/x", False),
    ("/sx/job-1/checkpoints", False), ("s3://b/p/job-1/checkpoints/step-3", False),
])
def test_checkpoint_paths_rule(path: str, ok: bool) -> None:
    assert TelemetryGuard("/s", None).checkpoint_allowed("job-1", path) is ok
    if path.startswith("/s/"):
        assert TelemetryGuard("s3://b/p", None).checkpoint_allowed("job-1", "s3://b/p" + path[2:]) is ok


@pytest.mark.parametrize(("path", "ok"), [
    ("s3://b/p/job-1/checkpoints/step-3", True), ("S3://b/p/vigil-job-1/checkpoint_0001", True),
    ("s3://b/p/job-1/files/x", True), ("s3://b/p/job-1/checkpoints/step-3/", True),
    ("s3://b/p/job-2/checkpoints/step-3", False), ("s3://b/p/job-1", False), ("s3://b/p/job-1x/step-3", False),
    # An object store takes '.', '..' and '//' literally: "job-2/../job-1/x" is a key under job-2/, never job-1's.
    ("s3://b/p/job-2/../job-1/checkpoints/step-3", False), ("s3://b/p/job-1/../job-2/x", False),
    ("s3://b/p/./job-1/checkpoints/step-3", False), ("s3://b/p//job-1/checkpoints/step-3", False),
    ("s3://b/p/job-1/./x", False), ("s3://other/p/job-1/checkpoints/step-3", False),
    ("s3://b/px/job-1/checkpoints/step-3", False), ("s3a://b/p/job-1/checkpoints/step-3", False),
    ("gs://b/p/job-1/checkpoints/step-3", False), ("/b/p/job-1/checkpoints/step-3", False),
    ("b/p/job-1/checkpoints/step-3", False), ("s3://", False),
])
def test_checkpoint_paths_rule_for_a_uri_storage(path: str, ok: bool) -> None:
    """A storage root that is a URI: the same rule, on the normalised URI (scheme in lower case, no
    trailing '/'), refusing any '.', '..' or empty segment instead of resolving it."""
    assert TelemetryGuard("s3://b/p/", None).checkpoint_allowed("job-1", path) is ok
    with pytest.raises(ValueError):
        TelemetryGuard("s3://b/p/../q", None)


def test_a_controller_with_s3_storage_hands_it_to_jobs_and_binds_their_checkpoints_to_it(
    tmp_path: Path, ray: StandInRay
) -> None:
    """``VIGIL_STORAGE_PATH=s3://...`` (the controller's ``storage_path``): jobs get the URI as it is, and a
    checkpoint is recorded only under the job's own prefix of it, over HTTP on a real controller."""
    from controller.app import job_env
    from vigil.contract.settings import ENV_STORAGE_PATH, Settings

    assert job_env(Settings(storage_path="S3://ckpt/team/")).get(ENV_STORAGE_PATH) == "s3://ckpt/team"
    c = LiveController(tmp_path / "controller", storage_path="s3://ckpt/team").start()
    try:
        assert c.app.state.telemetry_guard.storage == "s3://ckpt/team"
        job, other = launched(c, "s3-ckpt"), launched(c, "s3-other")
        mine = str(job_checkpoint_root("s3://ckpt/team", job)) + "/step-00000005"
        outside = [str(job_checkpoint_root("s3://ckpt/team", other)) + "/step-00000005",
                   f"s3://ckpt/team/{other}/../{job}/checkpoints/step-00000005", f"s3://ckpt/teamx/{job}/x",
                   str(tmp_path / job / "checkpoints" / "step-00000005")]
        before = refused("checkpoint_path")
        c.post_batch("vigil-node-1", [CheckpointSample(job_id=job, step=5, ts=1.0, path=p) for p in [*outside, mine]])
        with session_scope(c.app.state.sessions) as s:
            assert s.scalars(select(Checkpoint.path).where(Checkpoint.job_id == job)).all() == [mine]
        assert refused("checkpoint_path") - before == len(outside)
    finally:
        c.stop()


def test_placement_names_nodes_by_ray_name_or_by_ray_id() -> None:
    """Nodes `ray start` named (vigil up, an attached cluster) are known by name; one without a name by its id."""
    from controller.launcher import LaunchError, RayNode
    from controller.telemetry_guard import ray_placement

    class Launcher:
        def placement(self, launch_id: str) -> set[str]:
            if launch_id == "down":
                raise LaunchError("state API down")
            return {"aa11", "bb22"}

    class Cluster:
        def nodes(self) -> list[RayNode]:
            return [RayNode("aa11", "w1", "ALIVE"), RayNode("bb22", "w2", "ALIVE"), RayNode("cc33", "w3", "ALIVE")]

    where = ray_placement(Launcher(), Cluster())
    assert where is not None
    placed, known = where("vigil-job")
    assert {"w1", "w2", "aa11", "bb22"} <= placed and not placed & {"w3", "cc33"}
    assert {"w1", "w2", "w3", "cc33"} <= known
    assert where("down") is None  # Ray's API down: the check is skipped, telemetry kept
    assert ray_placement(object(), Cluster()) is None


@pytest.mark.parametrize("bad", [-0.5, float("inf"), float("nan"), -1e-9])
def test_a_ranks_run_queue_wait_is_a_finite_number_of_seconds_or_refused_by_name(bad: object) -> None:
    # A rank's own run-queue wait is what keeps a rank slowed by its host from being named a straggler. What a
    # rank can do with it: claim it for its own samples, which only reach its own job (the binding above);
    # anything but a finite number >= 0 is refused, naming the field.
    with pytest.raises(ValidationError) as e:
        StepSample.model_validate({**step_sample("j", 0, 1).model_dump(), "cpu_wait_s": bad})
    assert "cpu_wait_s" in str(e.value)
    assert StepSample.model_validate({**step_sample("j", 0, 1).model_dump(), "cpu_wait_s": 0.25}).cpu_wait_s == 0.25
