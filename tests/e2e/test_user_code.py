"""End to end: a user's own project (own model, data and loop on the rank API) submitted with
``vigil submit --working-dir``, on a real local Ray cluster (head + 2 worker raylets, real agents, the
real controller over HTTP with SQLite); and every bundled example submitted the same way.

The project is written into a temporary directory Vigil's package knows nothing about; the CLI runs as
a subprocess as a user runs it (it packs the folder, uploads it, submits). For a function entry point
and for a script entry point: the job reaches SUCCEEDED with per-rank step telemetry and per-collective
telemetry in the API, and a rank killed through the fault API makes the job resume from the project's
own checkpoint (the project's code writes down the step each start resumed from).

Needs: nothing outside the venv (Ray token auth on, as `vigil up` runs it). Slow: about 5 minutes.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ops.bench.security import submit_project as _vigil_submit
from ops.localcluster import LocalCluster
from tests.e2e.user_project import FUNCTION_PY, MODEL_PY, SCRIPT_PY, job_writable_dir
from tests.e2e.user_project import finish as _finish
from vigil import raytrain
from vigil.contract.client import VigilClient
from vigil.contract.probe import wait_for
from vigil.contract.schemas import CAPTURED_TAG, FaultCreate, IncidentKind
from vigil.driver import run_name

pytestmark = pytest.mark.slow

LAST = 240
"""Steps of the jobs a kill_rank fault hits: long enough that the rank still runs when the fault's file lands."""

RT_LAST = 600
"""Steps of the Ray Train job: long enough to still run when its hang fault's file lands (1-3 s after it is asked),
at the hundred-odd steps a second this small model runs."""

ROOT = Path(__file__).resolve().parents[2]
STEPS = 200
"""Steps of the user projects' jobs (0.04 s each): long enough to still run when a kill_rank fault asked for a step
already reached lands (a monitor pass and an agent's command poll, 1-3 s)."""
CKPT = 10


@pytest.fixture
def cluster(shared_cluster: LocalCluster) -> LocalCluster:
    return shared_cluster


@pytest.fixture
def client(shared_client: VigilClient) -> VigilClient:
    return shared_client


def _assert_telemetry(client: VigilClient, job_id: str, steps: int, first: int = 1) -> None:
    """Every rank's steps ``first``..``steps`` and the gradients' collectives in the API. Code that does not
    mark its steps is stepped by its optimizer, whose first step only starts the clock (``first`` 2)."""
    want = set(range(first, steps + 1))

    def complete() -> Any:  # the agents post the last steps up to a second or two after the job ends
        m = client.job_metrics(job_id, max_points=100_000)
        return m if len(m.ranks) == 2 and all(want <= set(s.step) for s in m.ranks) else None

    try:
        wait_for(complete, 30, f"{job_id}'s steps {first}..{steps} from both ranks", 0.5)
    except TimeoutError:
        pass  # said precisely below
    metrics = client.job_metrics(job_id, max_points=100_000)
    assert sorted(s.rank for s in metrics.ranks) == [0, 1], "step samples must arrive from every rank"
    for series in metrics.ranks:
        assert want <= set(series.step), f"rank {series.rank} misses steps {sorted(want - set(series.step))[:10]}"
    coll = client.job_collectives(job_id)
    # Vigil's optimizers' gradients ("grads"), or torch's own DDP buckets read from its Flight Recorder
    grads = [c for c in coll.data if (c.op, c.tag) in (("all_reduce", "grads"), ("all_reduce", CAPTURED_TAG))]
    assert grads, [(c.op, c.tag) for c in coll.data]
    assert grads[0].step and max(grads[0].ranks) == 2  # aggregated over both ranks


def _project(tmp: Path, kind: str, cluster: LocalCluster) -> tuple[Path, Path, Path]:
    """A user's project folder, its job spec, and the folder its code logs its starts to."""
    proj, logs = tmp / f"my-{kind}-project", job_writable_dir(cluster, f"{kind}-logs")
    proj.mkdir()
    (proj / "mymodel.py").write_text(textwrap.dedent(MODEL_PY))
    spec: dict = {
        "name": f"user-{kind}", "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}, "steps": STEPS,
        "checkpoint": {"interval_steps": CKPT, "keep_last": 3}, "recovery": {"policy": "evict_restart", "max_restarts": 3},
    }
    if kind == "function":
        (proj / "mytrain.py").write_text(FUNCTION_PY)
        spec |= {"entrypoint": "mytrain:train_func", "config": {"width": 32, "log_dir": str(logs)}}
    else:
        (proj / "train.py").write_text(SCRIPT_PY)
        spec["entrypoint"] = f"python train.py --width 32 --steps {STEPS} --log-dir {logs}"
    # What a user keeps out of the package: a .vigilignore'd data dump, never shipped.
    (proj / "scratch").mkdir()
    (proj / "scratch" / "dump.bin").write_bytes(os.urandom(1 << 20))
    (proj / ".vigilignore").write_text("scratch/\n")
    spec_file = tmp / f"{kind}-job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return proj, spec_file, logs


@pytest.mark.parametrize("kind", ["function", "script"])
def test_own_project_runs_is_observed_and_resumes_from_its_checkpoint_after_a_kill(
    kind: str, cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    proj, spec_file, logs = _project(tmp_path, kind, cluster)
    job_id = _vigil_submit(cluster, spec_file, proj)
    job = client.get_job(job_id)
    assert job.spec.working_dir is not None and job.spec.working_dir.startswith("sha256:")
    wait_for(lambda: (client.get_job(job_id).last_step or 0) >= 25, 240, f"{job_id} to reach step 25")
    client.inject_fault(job_id, FaultCreate(kind="kill_rank", rank=1, step=25))
    _finish(client, job_id)
    _assert_telemetry(client, job_id, STEPS)
    inc = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.RANK_DIED]
    assert inc and inc[0].rank == 1 and inc[0].status.value == "RECOVERED", inc
    # The project's own record: a first start at 1, then a start after one of its checkpoints.
    for rank in (0, 1):
        starts = [int(x) for x in (logs / f"starts-{rank}.txt").read_text().split()]
        assert starts[0] == 1 and len(starts) >= 2, starts
        assert all(s > 1 and (s - 1) % CKPT == 0 for s in starts[1:]), starts


OWN_TESTS = {"ddp_plain", "fsdp2", "torchrun_script", "ray_train_unchanged", "gpt_pydoc"}
"""Examples submitted by tests of their own (below, with faults; the GPT demo is the default entry point of
the other end-to-end modules, tests/e2e/test_faults.py and test_local_cluster.py): not again here."""


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").iterdir()
                                           if (p / "job.yaml").exists() and p.name not in OWN_TESTS))
def test_every_example_submits_with_its_folder_and_succeeds(
    example: str, cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    folder = ROOT / "examples" / example
    spec = yaml.safe_load((folder / "job.yaml").read_text())
    spec["steps"] = min(spec.get("steps", 60), 60)  # as written, but short: it runs in every `make test`
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    job_id = _vigil_submit(cluster, spec_file, folder)
    _finish(client, job_id)
    spec = client.get_job(job_id).spec
    _assert_telemetry(client, job_id, spec.steps)


# A project whose modules bear the most common names of training projects: the plain DDP example's own
# code (torch's DDP and AdamW, only four `vigil.*` calls) as its `trainer` module, the entry point, beside
# its own model.py, data.py, utils.py, agent.py and examples/ (which its trainer.py imports nothing of).
COMMON_NAMES = {
    "model.py": "WIDTH = 64\n",
    "data.py": "SAMPLES = 8192\n",
    "utils.py": "def describe():\n    return 'the user utils'\n",
    "agent.py": "NAME = 'the user agent'\n",
    "examples/__init__.py": "",
}


def test_plain_ddp_project_with_common_module_names_is_watched_through_torchs_collectives(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    """examples/ddp_plain's code as the project's own trainer.py, beside its own model.py, data.py,
    utils.py, agent.py and examples/: it runs as it is; torch's DDP buckets show as collectives; a slow
    rank is named a straggler from them; when rank 1 falls asleep in the user's own loop the hang names it
    by the collective rank 0 waits in."""
    proj = tmp_path / "plain-ddp"
    for name, text in COMMON_NAMES.items():
        (proj / name).parent.mkdir(parents=True, exist_ok=True)
        (proj / name).write_text(text)
    example = (ROOT / "examples" / "ddp_plain" / "train.py").read_text()
    (proj / "trainer.py").write_text(example + textwrap.dedent("""

        def main(config):  # the project's own modules, each by its common name
            import agent, data, model, utils
            assert agent.NAME == "the user agent" and utils.describe() == "the user utils"
            train_func({**config, "width": model.WIDTH, "samples": data.SAMPLES})
        """))
    hang_at = 200
    spec = {"name": "plain-ddp", "entrypoint": "trainer:main",
            "config": {"load_s": 0.04, "stall": {"rank": 1, "step": hang_at}},
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}, "steps": 250,
            "checkpoint": {"interval_steps": 50, "keep_last": 2}, "recovery": {"policy": "observe"}}
    spec_file = tmp_path / "plain-ddp.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    job_id = _vigil_submit(cluster, spec_file, proj)
    try:
        at = _slow_rank_1_ahead(client, job_id)
        inc = _wait_hang_by_collective(client, job_id)
        found = inc.evidence["collectives"]
        why = "" if "1" in found["ranks"] else _silent_rank_1(client, job_id)
    finally:  # a hung job holds its CPUs: the next test needs them
        _cancel_and_free(client, job_id)
    assert found["not_entered"] == [1] and found["waiting_ranks"] == [0], _lineup(found) + why
    assert found["waiting_in"]["group"] == "world" and found["waiting_in"]["op"] == "all_reduce", found
    assert inc.rank == 1 and "rank 1 never entered it" in found["summary"]
    stragglers = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.STRAGGLER]
    assert stragglers and stragglers[0].rank == 1, [(i.kind, i.rank, i.evidence) for i in client.job_incidents(job_id).data]
    metrics = client.job_metrics(job_id, max_points=100_000)
    for series in metrics.ranks:
        assert set(range(1, hang_at)) <= set(series.step), f"rank {series.rank} misses steps"
    coll = client.job_collectives(job_id, raw=True)
    ddp = next(c for c in coll.data if (c.op, c.group, c.tag) == ("all_reduce", "world", CAPTURED_TAG))
    assert ddp.estimated and max(ddp.wire_bytes) > 0 and max(ddp.ranks) == 2
    assert coll.raw and all(c.estimated for c in coll.raw if c.tag == CAPTURED_TAG)
    # After the slow-down, rank 0 waits inside the gradient all-reduce for the slow rank 1, not the reverse.
    late = [c for c in coll.raw if at + 5 < c.step < hang_at and c.op == "all_reduce" and c.group == "world"]
    wait = {r: sum(c.wait_s for c in late if c.rank == r) for r in (0, 1)}
    assert wait[0] > 3 * wait[1], wait


def _slow_rank_1_ahead(client: VigilClient, job_id: str) -> int:
    """A 4x slow_rank on rank 1 from a step well ahead of the newest the controller has: the steps of code
    whose collectives are captured reach it a second or two late (vigil.capture); the step it asked for."""
    wait_for(lambda: (client.get_job(job_id).last_step or 0) >= 15, 240, f"{job_id} to reach step 15")
    at = (client.get_job(job_id).last_step or 15) + 60
    client.inject_fault(job_id, FaultCreate(kind="slow_rank", rank=1, step=at, params={"factor": 4, "mode": "compute"}))
    return at


def _lineup(found: dict[str, Any]) -> str:
    """The hang's line-up in one short line (pytest cuts a long message): who reported, and what each entered."""
    return (f"{found['summary']}; entered per rank: "
            f"{ {r: (v['entered'], v['step'], v['idle_s']) for r, v in found['ranks'].items()} }")


def _silent_rank_1(client: VigilClient, job_id: str) -> str:
    """What rank 1 did while its watcher's report was missing (seen in CI twice): its threads' stacks (the
    watcher's among them) and the driver log's lines about the watcher or telemetry."""
    try:
        stacks = client.job_stacks(job_id).stacks.get(1, "no stack")
        logs = client.job_logs(job_id, tail_bytes=200_000).logs.splitlines()
    except Exception as e:  # noqa: BLE001 - only a failure message: say why it is short
        return f"; rank 1 sent no report (its stacks and logs unreadable: {e})"
    lines = [ln for ln in logs if "watcher" in ln or "telemetry" in ln or "Error" in ln][-20:]
    return f"; rank 1 sent no report. Its stacks:\n{stacks}\nlog lines:\n" + "\n".join(lines)


def _wait_hang_by_collective(client: VigilClient, job_id: str) -> Any:
    def hang() -> Any:
        return next((i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.HANG
                     and "collectives" in i.evidence), None)

    return wait_for(hang, 300, f"{job_id}'s hang to be diagnosed", 0.5)


def _cancel_and_free(client: VigilClient, job_id: str) -> None:
    """Cancel a hung job and wait until no rank of it is alive on any node (the next test needs the CPUs)."""
    if not client.get_job(job_id).status.is_terminal():
        client.cancel_job(job_id)
    wait_for(lambda: client.get_job(job_id).status.is_terminal(), 120, f"{job_id} to stop")
    wait_for(lambda: not [r for n in client.list_nodes().data for r in n.ranks if r.job_id == job_id and r.alive],
             120, f"{job_id}'s ranks to be gone", 1)


def _torchrun_job(tmp_path: Path, cluster: LocalCluster, name: str, steps: int, args: str, policy: str) -> str:
    """The torchrun example with ``--steps steps ARGS``; the spec's ``steps`` says the same (after its last
    step a job is saving and exiting, not hung)."""
    spec = {"name": name, "entrypoint": f"python train.py --steps {steps} {args}",
            "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1}, "steps": steps,
            "recovery": {"policy": policy, "max_restarts": 3}}
    spec_file = tmp_path / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return _vigil_submit(cluster, spec_file, ROOT / "examples" / "torchrun_script")


def test_torchrun_script_as_it_is_shows_a_straggler_and_a_hang_by_collective(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    """The torchrun example, no Vigil import: steps from its optimizer, DDP's collectives from torch's Flight
    Recorder, a slow rank named a straggler, a rank asleep in the script named by the collective rank 0
    waits in."""
    hang_at = 200
    job_id = _torchrun_job(tmp_path, cluster, "torchrun-watch", 250,
                           f"--step-delay 0.04 --hang-rank 1 --hang-step {hang_at}", "observe")
    try:
        _slow_rank_1_ahead(client, job_id)
        inc = _wait_hang_by_collective(client, job_id)
    finally:  # a hung job holds its CPUs: the next test needs them
        _cancel_and_free(client, job_id)
    found = inc.evidence["collectives"]
    assert found["not_entered"] == [1] and found["waiting_in"]["op"] == "all_reduce", _lineup(found)
    assert inc.rank == 1
    stragglers = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.STRAGGLER]
    assert stragglers and stragglers[0].rank == 1, [(i.kind, i.rank) for i in client.job_incidents(job_id).data]
    metrics = client.job_metrics(job_id, max_points=100_000)
    for series in metrics.ranks:
        assert set(range(2, hang_at)) <= set(series.step), f"rank {series.rank} misses steps"
        assert all(t is not None and t > 0 for t in series.step_time_s)
    ddp = [c for c in client.job_collectives(job_id).data if (c.op, c.tag) == ("all_reduce", CAPTURED_TAG)]
    assert ddp and ddp[0].estimated and max(ddp[0].ranks) == 2


def test_torchrun_script_rank_killed_resumes_from_the_scripts_own_checkpoint(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    # 240 steps: the fault fires at the first step at or after the one asked for, if the rank still runs when
    # its file lands; at 120 (~4 s of steps) the job had once finished before it did (CI, twice in a Ray Train
    # job too)
    job_id = _torchrun_job(tmp_path, cluster, "torchrun-kill", LAST, "--step-delay 0.03 --checkpoint-every 20",
                           "evict_restart")
    wait_for(lambda: (client.get_job(job_id).last_step or 0) >= 30, 240, f"{job_id} to reach step 30")
    client.inject_fault(job_id, FaultCreate(kind="kill_rank", rank=1, step=(client.get_job(job_id).last_step or 30) + 5))
    _finish(client, job_id)
    inc = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.RANK_DIED]
    assert inc and inc[0].rank == 1, inc
    _assert_resumed_by_optimizer_count(client, job_id, every=20, last=LAST)


def _assert_resumed_by_optimizer_count(client: VigilClient, job_id: str, *, every: int, last: int) -> int:
    """AdamW's own count numbers the steps: after the restart they go on from the code's own checkpoint (a
    multiple of ``every``), not from 1; the restarted process's first optimizer step starts its clock."""
    series = next(s for s in client.job_metrics(job_id, max_points=100_000).ranks if s.rank == 0)
    rows = sorted(zip(series.ts, series.step, strict=True))
    ts, steps = [t for t, _ in rows], [s for _, s in rows]
    # The restart: the step number goes back, or (a re-run step's newest attempt replaces the old one in
    # the series) the steps pause while Ray Train restarts the group.
    back = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1] or ts[i] - ts[i - 1] > 5.0), None)
    assert back is not None, f"no restart visible in rank 0's steps: {steps}"
    assert steps[back] > every and (steps[back] - 2) % every == 0, steps[max(0, back - 3): back + 3]
    assert max(steps) == last
    return steps[back]


def test_ray_train_function_as_it_is_reports_its_loss_and_resumes_past_a_corrupt_checkpoint(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    """The Ray Train example (prepare_model, prepare_data_loader, get_checkpoint, report), unchanged: its
    reported losses are the steps' losses; its checkpoints carry Vigil's manifest and are listed; a killed
    rank restarts the group, whose get_checkpoint() passes over the newest checkpoints (corrupted while the
    group was down) to the oldest; its collectives are DDP's.

    The job is frozen before the corruption (rank 1 stopped at a step past two checkpoints, policy observe: Vigil
    leaves the hang alone), so no checkpoint can land after the ones listed; then rank 1 is killed from outside
    (its agent), and Ray Train restarts the group."""
    every, last = 20, RT_LAST
    spec = yaml.safe_load((ROOT / "examples" / "ray_train_unchanged" / "job.yaml").read_text())
    spec["config"] |= {"steps": last, "checkpoint_every": every}
    spec["steps"] = last
    spec["recovery"] = {"policy": "observe", "max_restarts": 3}
    spec_file = tmp_path / "rt.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    job_id = _vigil_submit(cluster, spec_file, ROOT / "examples" / "ray_train_unchanged")
    client.inject_fault(job_id, FaultCreate(kind="hang_rank", rank=1, step=2 * every + 5))  # fires at the first step >= it
    try:
        wait_for(lambda: _frozen(client, job_id), 240, f"{job_id} to stop at rank 1's hang")
    except TimeoutError as e:  # what the fault, the job and its incidents were doing, for a run in CI
        job = client.get_job(job_id)
        raise TimeoutError(f"{e}; job {job.state} at step {job.last_step}; faults {client.list_faults(job_id).data}; "
                           f"incidents {client.job_incidents(job_id).data}") from e
    # Rank 0 waits in a collective for its stopped peer: no checkpoint comes now. Which one Ray Train hands back
    # to the restarted group is its own (the newest that every rank reported); all but the oldest are corrupted,
    # so whichever it picks fails its manifest and the oldest is the one that verifies.
    run = cluster.storage / run_name(job_id)
    saved = sorted((json.loads(m.read_text())["step"], m.parent) for m in run.glob(f"*/{raytrain.MANIFEST}"))
    assert len(saved) >= 2, f"Vigil manifests under {run}: {saved}"
    for _, folder in saved[1:]:
        state = folder / "state.pt"
        data = state.read_bytes()
        state.write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:])
    # From outside (its agent): a stopped rank cannot carry out a fault itself.
    client.inject_fault(job_id, FaultCreate(kind="kill_rank", rank=1, step=0, params={"mode": "agent"}))
    _finish(client, job_id)
    inc = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.RANK_DIED]
    assert inc and inc[0].rank == 1, inc
    resumed = _assert_resumed_by_optimizer_count(client, job_id, every=every, last=last)
    assert resumed == saved[0][0] + 2, (resumed, saved)  # from the one checkpoint left that verifies
    ckpts = client.job_checkpoints(job_id).data
    skipped = {c.step for c in ckpts if not c.valid}
    assert skipped and skipped <= {s for s, _ in saved[1:]}, (skipped, ckpts)  # what was passed over, said
    good = [c for c in ckpts if c.valid]
    assert {c.step for c in good} >= {every, last} and all(c.bytes > 0 and c.files >= 1 for c in good), good
    # The losses the code reported (at its checkpoint steps) are the steps' losses: the first report's, and every one
    # of the run that went on from the restored step to the end. (Not those the stopped group ran last: a rank
    # holds its newest steps' samples until its next Flight Recorder read, and Ray Train killed the frozen ranks
    # with them; the restored run starts after some of them.)
    series = next(s for s in client.job_metrics(job_id, max_points=100_000).ranks if s.rank == 0)
    losses = dict(zip(series.step, series.loss, strict=True))
    missing = [s for s in [every, *range(resumed - 2 + every, last + 1, every)] if losses.get(s) is None]
    assert not missing, f"report steps without their loss: {missing}; rank 0's steps: {list(zip(series.step, series.loss))}"
    ddp = [c for c in client.job_collectives(job_id).data if (c.op, c.tag) == ("all_reduce", CAPTURED_TAG)]
    assert ddp and ddp[0].estimated and max(ddp[0].ranks) == 2


def _frozen(client: VigilClient, job_id: str) -> bool:
    """The job has stepped, and its step stood still for 2 s (the telemetry of the steps before a hang may never
    come: the step a hung job is seen at can be below the hang's)."""
    before = client.get_job(job_id).last_step
    time.sleep(2)
    return before is not None and client.get_job(job_id).last_step == before


def _fsdp2_job(tmp_path: Path, cluster: LocalCluster, name: str, steps: int, config: dict[str, Any],
               policy: str) -> str:
    spec = yaml.safe_load((ROOT / "examples" / "fsdp2" / "job.yaml").read_text())
    spec |= {"name": name, "steps": steps, "recovery": {"policy": policy, "max_restarts": 3}}
    spec["config"] |= config
    spec_file = tmp_path / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return _vigil_submit(cluster, spec_file, ROOT / "examples" / "fsdp2")


def test_fsdp2_shows_its_all_gathers_a_straggler_and_a_hang_by_collective(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    """The FSDP2 example (fully_shard on a CPU mesh, torch's AdamW): FSDP2's parameter all-gathers and
    gradient reductions read from torch's Flight Recorder, a slow rank named a straggler, a rank asleep in
    the example's own loop named by the collective rank 0 waits in."""
    hang_at = 200
    job_id = _fsdp2_job(tmp_path, cluster, "fsdp2-watch", 250, {"load_s": 0.04, "stall": {"rank": 1, "step": hang_at}},
                        "observe")
    try:
        _slow_rank_1_ahead(client, job_id)
        inc = _wait_hang_by_collective(client, job_id)
        found = inc.evidence["collectives"]
        why = "" if "1" in found["ranks"] else _silent_rank_1(client, job_id)
    finally:  # a hung job holds its CPUs: the next test needs them
        _cancel_and_free(client, job_id)
    assert found["not_entered"] == [1] and found["waiting_ranks"] == [0], _lineup(found) + why
    assert inc.rank == 1 and "rank 1 never entered it" in found["summary"]
    stragglers = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.STRAGGLER]
    assert stragglers and stragglers[0].rank == 1, [(i.kind, i.rank) for i in client.job_incidents(job_id).data]
    coll = client.job_collectives(job_id).data
    ops = {c.op for c in coll if c.tag == CAPTURED_TAG and c.estimated and max(c.ranks) == 2}
    assert "all_gather" in ops, ops  # FSDP2 gathers each block's parameters before it runs
    for series in client.job_metrics(job_id, max_points=100_000).ranks:
        assert set(range(1, hang_at)) <= set(series.step), f"rank {series.rank} misses steps"


def test_fsdp2_rank_killed_resumes_from_its_own_sharded_checkpoint(
    cluster: LocalCluster, client: VigilClient, tmp_path: Path
) -> None:
    """A killed FSDP2 rank restarts the group, which loads the example's own DCP checkpoint (every rank its
    shards) and goes on from the step after it."""
    every, last = 20, 240  # the fault's file lands 1-3 s after it is asked: the job still runs then
    job_id = _fsdp2_job(tmp_path, cluster, "fsdp2-kill", last, {"checkpoint_every": every, "load_s": 0.02},
                        "evict_restart")
    wait_for(lambda: (client.get_job(job_id).last_step or 0) >= 30, 240, f"{job_id} to reach step 30")
    client.inject_fault(job_id, FaultCreate(kind="kill_rank", rank=1, step=(client.get_job(job_id).last_step or 30) + 5))
    _finish(client, job_id)
    inc = [i for i in client.job_incidents(job_id).data if i.kind == IncidentKind.RANK_DIED]
    assert inc and inc[0].rank == 1 and inc[0].status.value == "RECOVERED", inc
    series = next(s for s in client.job_metrics(job_id, max_points=100_000).ranks if s.rank == 1)
    rows = sorted(zip(series.ts, series.step, strict=True))
    ts, steps = [t for t, _ in rows], [s for _, s in rows]
    back = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1] or ts[i] - ts[i - 1] > 5.0), None)
    assert back is not None, f"no restart visible in rank 1's steps: {steps}"
    assert steps[back] > every and (steps[back] - 1) % every == 0, steps[max(0, back - 3): back + 3]
    assert max(steps) == last
