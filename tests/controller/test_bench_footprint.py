"""`vigil bench footprint` without a cluster: which process is which kind, the CPU counted per phase from
readings, and the ratios of the report. Fast; the one subprocess is `vigil bench footprint --help`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ops.bench.footprint import (
    KINDS,
    VARIANTS,
    Proc,
    ProcInfo,
    Sample,
    classify,
    classify_tree,
    phase_cpu,
    phase_summary,
    rank_line_copies,
    ratios,
    sample_until,
    select_cluster,
    take_sample,
    vigil_share,
)
from ops.localcluster import RAY_ENV

PY = "/work/main/.venv/bin/python"
RAY = "/work/main/.venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize(("cmdline", "kind"), [
    ([PY, "-u", f"{RAY}/_private/log_monitor.py", "--session-dir=/tmp/vr-x/session_1", "--gcs-address=1:2"],
     "ray_log_monitor"),
    # A raylet's arguments name the worker and agent commands it starts: only the program counts.
    ([f"{RAY}/core/src/ray/raylet/raylet", "--python_worker_command=python default_worker.py",
      f"--dashboard_agent_command={PY} {RAY}/dashboard/agent.py"], "ray_raylet"),
    ([f"{RAY}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/vr-x"], "ray_gcs"),
    ([PY, f"{RAY}/dashboard/dashboard.py", "--host=127.0.0.1"], "ray_dashboard"),
    (["ray-dashboard-JobHead-0 (/work/main/.venv/bin/python /x/dashboard.py --host=127.0.0.1)"], "ray_dashboard"),
    (["ray-dashboard-StateHead-0", f"({PY}", "-c", "x)"], "ray_dashboard"),
    (["ray::DashboardAgent"], "ray_dashboard_agent"),
    ([PY, "-u", f"{RAY}/dashboard/agent.py", "--node-ip-address=127.0.0.1"], "ray_dashboard_agent"),
    (["ray::RuntimeEnvAgent"], "ray_runtime_env_agent"),
    ([PY, "-u", f"{RAY}/_private/runtime_env/agent/main.py", "--node-ip-address=127.0.0.1"], "ray_runtime_env_agent"),
    (["ray::IDLE"], "ray_workers"),
    (["ray::RayTrainWorker.run_train_fn", "", ""], "ray_workers"),
    (["ray::JobSupervisor"], "ray_workers"),
    ([PY, "-X", "utf8", f"{RAY}/_private/workers/default_worker.py", "--node-ip-address=127.0.0.1"], "ray_workers"),
    ([PY, "/work/main/.venv/bin/ray", "start", "--head", "--block", "--temp-dir=/tmp/vr-x"], "ray_start"),
    (["/work/main/.venv/bin/ray", "start", "--address=127.0.0.1:1", "--block"], "ray_start"),
    ([PY, "-m", "ops.cli", "controller", "--port", "8000"], "vigil_controller"),
    ([PY, "-m", "ops.cli", "agent", "--node-id", "vigil-node-1"], "vigil_agent"),
    (["/work/main/.venv/bin/vigil", "agent", "--node-id", "vigil-node-1"], "vigil_agent"),
    ([PY, "-m", "agent", "--node-id", "m1", "--controller", "http://x:1"], "vigil_agent"),
    ([PY, "-m", "vigil"], "vigil_driver"),
    (["/bin/sh", "-c", f"{PY} -m vigil"], "vigil_driver"),
    # Not recognised by themselves: the tree decides (classify_tree).
    ([PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)", "--multiprocessing-fork"],
     None),
    ([PY, "-m", "ops.cli", "bench", "footprint"], None),
    ([PY, "-m", "vigil.bench.comm"], None),
    ([PY, f"{RAY}/autoscaler/_private/monitor.py", "--logs-dir=/tmp/vr-x"], None),
    (["/usr/lib/erlang/erts/bin/beam.smp", "--", "-root", "/usr/lib/erlang"], None),
    ([], None),
    ([""], None),
])
def test_classify_by_the_program_not_its_arguments(cmdline: list[str], kind: str | None) -> None:
    assert classify(cmdline) == kind


def _info(ppid: int, *cmd: str, cpu: float = 0.0, created: float = 0.0) -> ProcInfo:
    return ProcInfo(ppid, cmd, created, cpu)


def test_unrecognised_processes_take_an_inheriting_ancestors_kind_or_are_other() -> None:
    procs = {
        10: _info(1, PY, "-m", "ops.cli", "controller"),
        11: _info(10, PY, "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"),
        12: _info(11, PY, "-c", "from multiprocessing.resource_tracker import main"),  # a grandchild
        20: _info(1, "/x/ray", "start", "--head", "--block"),
        21: _info(20, PY, f"{RAY}/autoscaler/_private/monitor.py"),  # ray start's: not an inheriting kind
        22: _info(20, "/x/raylet"),
        23: _info(22, "ray::RayTrainWorker"),
        24: _info(23, "/usr/bin/torchrun-ish"),  # a rank's own subprocess
        30: _info(999, "/bin/true"),  # its parent is not in the table
    }
    assert classify_tree(procs) == {10: "vigil_controller", 11: "vigil_controller", 12: "vigil_controller",
                                    20: "ray_start", 21: "other_of_cluster", 22: "ray_raylet", 23: "ray_workers",
                                    24: "ray_workers", 30: "other_of_cluster"}


def test_a_cycle_of_parents_does_not_hang() -> None:
    assert classify_tree({5: _info(6, "/bin/a"), 6: _info(5, "/bin/b")}) == {5: "other_of_cluster",
                                                                           6: "other_of_cluster"}


def test_only_the_clusters_processes_are_selected() -> None:
    procs = {
        1: _info(0, "/sbin/init"),
        100: _info(1, PY, "-m", "ops.cli", "bench", "footprint"),  # the bench: its tree, not itself
        101: _info(100, "/x/ray", "start", "--head"),
        102: _info(101, "/x/raylet"),
        200: _info(1, "/x/gcs_server", "--log_dir=/tmp/vr-abc/session_1/logs"),  # reparented, by its temp dir
        201: _info(200, "/x/child-of-marked"),
        300: _info(1, "/usr/lib/erlang/erts/bin/beam.smp"),  # the machine's other services
        301: _info(1, "/usr/bin/redis-server"),
        302: _info(1, "/x/gcs_server", "--log_dir=/tmp/vr-other/session_2/logs"),  # another cluster
    }
    assert sorted(select_cluster(procs, 100, ["/tmp/vr-abc", ""])) == [101, 102, 200, 201]


def test_take_sample_keys_by_pid_and_creation_time() -> None:
    table = {7: _info(1, "ray::IDLE", cpu=1.5, created=40.0), 8: _info(7, "/bin/x", cpu=0.5, created=41.0)}
    s = take_sample(["ray::"], read=lambda: table, root=1, clock=lambda: 50.0)
    assert s.t == 50.0
    assert s.procs == {(7, 40.0): Proc("ray_workers", 1.5, 40.0), (8, 41.0): Proc("ray_workers", 0.5, 41.0)}


def _sample(t: float, **procs: tuple[str, float, float]) -> Sample:
    """``name=(kind, cpu_s, created)``; the pid is the name's hash, stable within a test."""
    return Sample(t, {(hash(k), created): Proc(kind, cpu, created) for k, (kind, cpu, created) in procs.items()})


def test_phase_cpu_counts_increases_between_readings_and_newborns_whole() -> None:
    samples = [
        _sample(100.0, raylet=("ray_raylet", 10.0, 0.0), lm=("ray_log_monitor", 5.0, 0.0),
                gone=("ray_workers", 3.0, 50.0)),
        # a worker born in this interval: all its CPU counts; `gone` ended: its last interval is lost.
        _sample(102.0, raylet=("ray_raylet", 10.4, 0.0), lm=("ray_log_monitor", 5.3, 0.0),
                new=("ray_workers", 2.0, 101.0)),
        # `late` was there before the phase but not read then: no baseline, nothing counted this time.
        _sample(104.0, raylet=("ray_raylet", 10.6, 0.0), lm=("ray_log_monitor", 5.5, 0.0),
                new=("ray_workers", 2.5, 101.0), late=("vigil_agent", 9.0, 1.0)),
        _sample(106.0, raylet=("ray_raylet", 10.6, 0.0), lm=("ray_log_monitor", 5.6, 0.0),
                new=("ray_workers", 2.5, 101.0), late=("vigil_agent", 9.2, 1.0)),
    ]
    cpu = phase_cpu(samples)
    assert set(cpu) == set(KINDS)
    assert cpu["ray_raylet"] == pytest.approx(0.6)
    assert cpu["ray_log_monitor"] == pytest.approx(0.6)
    assert cpu["ray_workers"] == pytest.approx(2.5)
    assert cpu["vigil_agent"] == pytest.approx(0.2)
    assert cpu["ray_gcs"] == 0.0
    summary = phase_summary(samples)
    assert summary["wall_s"] == 6.0
    assert summary["cpu_total_s"] == pytest.approx(3.9)
    assert summary["processes"]["ray_workers"] == 2 and summary["processes"]["ray_log_monitor"] == 1


def test_a_reused_pid_is_another_process() -> None:
    samples = [_sample(0.0), Sample(2.0, {(7, -5.0): Proc("ray_workers", 30.0, -5.0)}),
               Sample(4.0, {(7, 3.0): Proc("ray_workers", 1.0, 3.0)})]
    # The first pid 7 existed before the phase but was not read then (no baseline); the second was born at 3.0.
    assert phase_cpu(samples)["ray_workers"] == pytest.approx(1.0)


def test_one_reading_is_an_empty_phase() -> None:
    assert phase_summary([_sample(5.0, a=("ray_raylet", 1.0, 0.0))]) == {
        "wall_s": 0.0, "cpu_s": dict.fromkeys(KINDS, 0.0), "cpu_total_s": 0.0,
        "processes": {k: int(k == "ray_raylet") for k in KINDS}}


def test_sample_until_reads_once_more_after_done() -> None:
    clock = iter(range(100))
    answers = iter([False, False, True])
    got = sample_until(lambda: next(answers), lambda: Sample(float(next(clock))), 2.0, sleep=lambda s: None)
    assert [s.t for s in got] == [0.0, 1.0, 2.0, 3.0]


def _phase(wall: float, total: float, **cpu: float) -> dict:
    return {"wall_s": wall, "cpu_s": dict(cpu), "cpu_total_s": total}


def test_ratios_are_per_second_of_each_phase() -> None:
    variants = {
        "ray_default": {"job": _phase(100.0, 150.0, ray_log_monitor=40.0),
                        "idle": _phase(40.0, 32.0, ray_log_monitor=16.0)},
        # A longer job: per second, not per phase.
        "vigil": {"job": _phase(120.0, 120.0, ray_log_monitor=24.0), "idle": _phase(50.0, 20.0, ray_log_monitor=5.0)},
    }
    assert ratios(variants) == {"log_monitor_idle": 0.25, "log_monitor_job": 0.5, "total_idle": 0.5,
                                "total_job": round(1.0 / 1.5, 3)}


def test_ratios_without_a_baseline_or_with_zero_cpu_are_none() -> None:
    vigil = {"job": _phase(10.0, 5.0, ray_log_monitor=1.0), "idle": _phase(10.0, 1.0)}
    assert ratios({"vigil": vigil}) == dict.fromkeys(("log_monitor_idle", "log_monitor_job", "total_idle",
                                                       "total_job"))
    zero = {"job": _phase(10.0, 0.0), "idle": _phase(0.0, 0.0)}
    assert ratios({"vigil": vigil, "ray_default": zero}) == dict.fromkeys(
        ("log_monitor_idle", "log_monitor_job", "total_idle", "total_job"))


def test_vigil_share_is_percent_of_one_core_per_agent() -> None:
    job = _phase(50.0, 80.0, vigil_agent=5.0, vigil_controller=4.0)
    assert vigil_share(job, agents=5) == {"agent_cpu_pct_per_node": 2.0, "controller_cpu_pct": 8.0}
    assert vigil_share(_phase(0.0, 0.0), agents=5) == {"agent_cpu_pct_per_node": None, "controller_cpu_pct": None}


def test_rank_line_copies_counts_the_most_repeated_rank_line() -> None:
    line0 = "(RayTrainWorker pid=5) INFO vigil.runner: rank 0 (node vigil-node-1) finished at step 60"
    line1 = "(RayTrainWorker pid=6) INFO vigil.raytrain: rank 1: checkpoint of step 20 (3 files) at /x"
    assert rank_line_copies(f"{line0}\n{line1}\n{line0}\ndriver: rank 0 started\n{line0}") == 3
    assert rank_line_copies(line1) == 1
    assert rank_line_copies("Running entrypoint for job x\nno ranks here") == 0


def test_variants_are_rays_default_then_vigils_setting() -> None:
    assert list(VARIANTS) == ["ray_default", "vigil"]
    assert VARIANTS == {"ray_default": "1000", "vigil": RAY_ENV["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"]}


def test_help_through_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "footprint", "--help"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "usage: vigil bench footprint" in r.stdout and "--idle-s" in r.stdout and "--json" in r.stdout
