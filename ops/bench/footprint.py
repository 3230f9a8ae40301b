"""``vigil bench footprint``: the CPU a local Vigil cluster costs, by process kind, under Ray's log-monitor
default and under the setting Vigil uses (``ops.localcluster.RAY_ENV``), in one run.

For each variant in turn it starts a local cluster (:func:`ops.localcluster.start_local_cluster`: a Ray head
with no CPUs plus ``--nodes`` worker raylets, one agent per raylet, the controller), runs one small 2-rank job
through the controller, then leaves the cluster idle for ``--idle-s`` seconds, and stops it. ``ray_default``:
Ray as it starts by default (``ray_defaults=True``): a log monitor on every raylet, all watching the one session
log folder, each listing it on every 0.1 s pass (``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=1000``). ``vigil``: the
setting Vigil uses, one log monitor (the head's) listing the folder every 0.5 s (the threshold of ``RAY_ENV``).

Every ``--interval`` seconds (2) it reads with psutil the CPU time (user + system) of every process of
the cluster and counts, by kind (:data:`KINDS`), the time used between two readings, in two phases:
``job`` (submit to end) and ``idle``. A process first seen after the previous reading counts its whole
CPU time (it was born in that interval). What it cannot see: the last interval of a process that ended
(its final CPU time cannot be read any more), and processes that start and end between two readings
(a shell, a short ``ray`` command): processes living under about 2 s are not counted. The bench's own
process (its sampling, the cluster's agent keeper thread) is not counted either.

The processes of the cluster: this process's descendants, and processes whose command line names the
cluster's Ray temp dir or home (and theirs): other services on the machine are not counted.

It also checks, per variant, that the ranks' log lines still reach the job's driver log
(``rank_logs_forwarded``), which is what a log monitor is for.

Prints JSON with ``--json``; a short table otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import psutil

from ops.bench.faultrun import UNREACHABLE
from ops.localcluster import RAY_ENV, LocalCluster, free_port, start_local_cluster
from vigil.contract.client import VigilClient
from vigil.contract.schemas import JobCreate, JobStatus

log = logging.getLogger("vigil.bench.footprint")

THRESHOLD_ENV = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
VARIANTS = {"ray_default": "1000", "vigil": RAY_ENV[THRESHOLD_ENV]}
"""Variant -> the log monitors' ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD``: Ray's default, then Vigil's (set in
this process's environment for the start: the operator's would win over RAY_ENV)."""

KINDS = ("ray_log_monitor", "ray_raylet", "ray_gcs", "ray_dashboard", "ray_dashboard_agent", "ray_runtime_env_agent",
         "ray_workers", "ray_start", "vigil_controller", "vigil_agent", "vigil_driver", "other_of_cluster")
"""The kinds of process whose CPU is counted, in the order they are printed."""

INHERITED = frozenset({"ray_workers", "ray_dashboard", "vigil_controller", "vigil_agent", "vigil_driver"})
"""Kinds whose unrecognised descendants count as theirs: a rank's own subprocesses, the dashboard's modules,
the controller's aggregation process, a tool the agent runs. Anything else unrecognised is ``other_of_cluster``."""

RANK_LINE = re.compile(r"rank \d+: checkpoint of step \d+|rank \d+ \(node [^)]*\) finished at step \d+")
"""A line a rank logs (vigil/raytrain.py, vigil/runner.py); found in the driver's log, the log monitors forwarded it."""

_SCRIPTS = (("log_monitor.py", "ray_log_monitor"), ("dashboard/dashboard.py", "ray_dashboard"),
            ("dashboard/agent.py", "ray_dashboard_agent"), ("runtime_env/agent/main.py", "ray_runtime_env_agent"),
            ("default_worker.py", "ray_workers"))
"""Python scripts of Ray's processes (before they set their process title), by the end of their path."""


# -- which process is what ------------------------------------------------------------------------------
def _program(argv: Sequence[str]) -> tuple[str, str | None, str | None]:
    """(script or ``-m`` module, first argument after it, ``"-m"``/``"-c"``/``""``) of a Python command line."""
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok in ("-m", "-c"):
            nxt = argv[i + 2] if i + 2 < len(argv) else None
            return (argv[i + 1] if i + 1 < len(argv) else ""), nxt, tok
        if tok in ("-X", "-W"):
            i += 2
            continue
        if not tok.startswith("-"):
            return tok, (argv[i + 1] if i + 1 < len(argv) else None), ""
        i += 1
    return "", None, ""


def classify(cmdline: Sequence[str]) -> str | None:
    """The kind (one of :data:`KINDS` but ``other_of_cluster``) of a process by its command line; None when
    it is none of them.

    Only the program is looked at, never its arguments: a raylet's arguments name ``default_worker.py`` and
    ``dashboard/agent.py`` (the commands it starts). Ray's processes that set a title (``ray::IDLE``,
    ``ray::DashboardAgent``, ``ray-dashboard-JobHead-0 (...)``) may show it as one string.
    """
    if not cmdline or not cmdline[0]:
        return None
    first = cmdline[0]
    for prefix, kind in (("ray::DashboardAgent", "ray_dashboard_agent"), ("ray::RuntimeEnvAgent", "ray_runtime_env_agent"),
                         ("ray::", "ray_workers"), ("ray-dashboard-", "ray_dashboard")):
        if first.startswith(prefix):
            return kind
    argv = list(cmdline) if len(cmdline) > 1 else first.split()
    exe = os.path.basename(argv[0])
    if exe in ("raylet", "gcs_server"):
        return "ray_raylet" if exe == "raylet" else "ray_gcs"
    if exe in ("sh", "bash", "dash") and len(argv) > 2 and argv[1] == "-c":
        return classify(argv[2].split())  # a job entrypoint run through a shell
    if not exe.startswith("python"):
        return _command(exe, argv[1] if len(argv) > 1 else None)
    program, arg, how = _program(argv)
    if how == "-m":
        return _module(program, arg)
    if how == "-c":
        return None
    for end, kind in _SCRIPTS:
        if program.endswith(end):
            return kind
    return _command(os.path.basename(program), arg)


def _command(name: str, arg: str | None) -> str | None:
    """A console script (``ray start``, ``vigil agent``) by its name and first argument."""
    if name == "ray" and arg == "start":
        return "ray_start"
    if name == "vigil":
        return {"controller": "vigil_controller", "agent": "vigil_agent"}.get(arg or "")
    return None


def _module(module: str, arg: str | None) -> str | None:
    if module == "ops.cli":
        return _command("vigil", arg)
    if module == "vigil":
        return "vigil_driver"
    if module == "agent":  # an agent Ray runs for an attached cluster (controller/agent_host.py)
        return "vigil_agent"
    return None


@dataclass(frozen=True)
class ProcInfo:
    """What one reading knows of a process."""

    ppid: int
    cmdline: tuple[str, ...]
    created: float
    cpu_s: float
    """User + system CPU seconds so far (its own, not its reaped children's)."""


def classify_tree(procs: Mapping[int, ProcInfo]) -> dict[int, str]:
    """pid -> kind for every process of ``procs``: by its command line, else its nearest recognised ancestor's
    kind when that is one of :data:`INHERITED`, else ``other_of_cluster``."""
    own = {pid: classify(p.cmdline) for pid, p in procs.items()}
    kinds: dict[int, str] = {}
    for pid in procs:
        kind, seen, cur = own[pid], {pid}, procs[pid].ppid
        while kind is None and cur in procs and cur not in seen:
            up = own[cur]
            if up is not None:
                kind = up if up in INHERITED else "other_of_cluster"
            seen.add(cur)
            cur = procs[cur].ppid
        kinds[pid] = kind or "other_of_cluster"
    return kinds


def select_cluster(procs: Mapping[int, ProcInfo], root: int, markers: Iterable[str]) -> dict[int, ProcInfo]:
    """The processes of the cluster: ``root``'s descendants, and processes whose command line holds one of
    ``markers`` (the cluster's Ray temp dir, its home) with their descendants; ``root`` itself excluded."""
    markers = [m for m in markers if m]
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    todo = [root, *(pid for pid, p in procs.items() if any(m in " ".join(p.cmdline) for m in markers))]
    chosen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in chosen:
            continue
        chosen.add(pid)
        todo.extend(children.get(pid, ()))
    chosen.discard(root)
    return {pid: procs[pid] for pid in chosen if pid in procs}


# -- readings and phases ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    kind: str
    cpu_s: float
    created: float


@dataclass
class Sample:
    """One reading: its time and, per process (pid, creation time), its kind and CPU seconds so far."""

    t: float
    procs: dict[tuple[int, float], Proc] = field(default_factory=dict)


def read_processes() -> dict[int, ProcInfo]:
    """Every process of the machine that psutil can read (one that vanishes meanwhile is left out)."""
    out: dict[int, ProcInfo] = {}
    for p in psutil.process_iter(["ppid", "cmdline", "create_time", "cpu_times"]):
        info = p.info
        times = info.get("cpu_times")
        if times is None or info.get("create_time") is None:
            continue
        out[p.pid] = ProcInfo(info.get("ppid") or 0, tuple(info.get("cmdline") or ()), info["create_time"],
                              times.user + times.system)
    return out


def take_sample(markers: Sequence[str], read: Callable[[], dict[int, ProcInfo]] = read_processes,
                root: int | None = None, clock: Callable[[], float] = time.time) -> Sample:
    """A reading of the cluster's processes (``read``: the psutil seam)."""
    t = clock()
    procs = select_cluster(read(), os.getpid() if root is None else root, markers)
    kinds = classify_tree(procs)
    return Sample(t, {(pid, p.created): Proc(kinds[pid], p.cpu_s, p.created) for pid, p in procs.items()})


def phase_cpu(samples: Sequence[Sample]) -> dict[str, float]:
    """CPU seconds by kind between the first and the last reading: each process's increase from one reading to
    the next; a process first seen after the previous reading counts all its CPU time (born in between);
    one seen before, or gone, counts nothing more."""
    totals = dict.fromkeys(KINDS, 0.0)
    for prev, cur in pairwise(samples):
        for key, p in cur.procs.items():
            before = prev.procs.get(key)
            if before is not None:
                used = p.cpu_s - before.cpu_s
            elif p.created >= prev.t:
                used = p.cpu_s
            else:
                used = 0.0  # there before but not read then (unreadable for a moment): no baseline
            totals[p.kind] = totals.get(p.kind, 0.0) + max(0.0, used)
    return totals


def phase_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """``{"wall_s", "cpu_s": {kind: s}, "cpu_total_s", "processes": {kind: n}}`` of one phase's readings
    (``processes``: how many of each kind were seen, e.g. the log monitors)."""
    wall = samples[-1].t - samples[0].t if len(samples) > 1 else 0.0
    cpu = phase_cpu(samples)
    seen = {key: p.kind for s in samples for key, p in s.procs.items()}
    return {"wall_s": round(wall, 2), "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
            "cpu_total_s": round(sum(cpu.values()), 3),
            "processes": {k: sum(1 for kind in seen.values() if kind == k) for k in KINDS}}


def sample_until(done: Callable[[], bool], sample: Callable[[], Sample], interval: float,
                 sleep: Callable[[float], None] = time.sleep) -> list[Sample]:
    """Readings every ``interval`` seconds, the first now, the last once ``done()`` is true."""
    samples = [sample()]
    while True:
        finished = done()
        if not finished:
            sleep(max(0.0, interval - (time.time() - samples[-1].t)))
        samples.append(sample())
        if finished:
            return samples


# -- arithmetic of the report ----------------------------------------------------------------------------
def _rate(phase: Mapping[str, Any], kind: str | None) -> float | None:
    """CPU seconds per second of the phase: of ``kind``, or of all kinds (None)."""
    if not phase.get("wall_s"):
        return None
    cpu = phase["cpu_total_s"] if kind is None else phase["cpu_s"].get(kind, 0.0)
    return float(cpu) / float(phase["wall_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """vigil over ray_default, per second of each phase: the log monitors' CPU and the cluster's total."""
    vigil, ray = variants.get("vigil") or {}, variants.get("ray_default") or {}
    out: dict[str, float | None] = {}
    for name, kind in (("log_monitor", "ray_log_monitor"), ("total", None)):
        for phase in ("idle", "job"):
            ok = phase in vigil and phase in ray
            out[f"{name}_{phase}"] = _ratio(_rate(vigil[phase], kind), _rate(ray[phase], kind)) if ok else None
    return out


def vigil_share(job_phase: Mapping[str, Any], agents: int) -> dict[str, float | None]:
    """Vigil's own processes while the job ran, in percent of one core: an agent's (the mean over ``agents``)
    and the controller's."""
    agent, controller = _rate(job_phase, "vigil_agent"), _rate(job_phase, "vigil_controller")
    return {"agent_cpu_pct_per_node": round(100 * agent / agents, 2) if agent is not None and agents else None,
            "controller_cpu_pct": round(100 * controller, 2) if controller is not None else None}


def rank_line_copies(logs: str) -> int:
    """How many times the driver's log holds the most repeated rank line (:data:`RANK_LINE`): 1 when one log
    monitor forwards it, up to one per monitor when several watch the same folder; 0 when none arrived."""
    counts = Counter(m.group(0) for m in RANK_LINE.finditer(logs))
    return max(counts.values(), default=0)


# -- one variant on a real cluster -----------------------------------------------------------------------
def job_spec(steps: int, ckpt: int) -> JobCreate:
    """A small 2-rank job (tests/e2e/test_faults.py's tiny GPT)."""
    return JobCreate.model_validate({
        "name": "bench-footprint",
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
        "data": {"max_bytes": 300_000},
        "optimizer": {"kind": "adamw", "lr": 0.01},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "steps": steps, "batch_size": 8,
        "lr_schedule": {"kind": "constant"},
        "checkpoint": {"interval_steps": ckpt, "keep_last": 3},
    })


def _start(threshold: str, nodes: int, ray_defaults: bool) -> LocalCluster:
    """A local cluster whose log monitors get ``threshold`` (this process's environment wins over RAY_ENV, so it
    is set here for the start and put back as it was); ``ray_defaults``: a log monitor on every raylet."""
    before = os.environ.get(THRESHOLD_ENV)
    os.environ[THRESHOLD_ENV] = threshold
    try:
        home = Path(tempfile.mkdtemp(prefix="vigil-bench-footprint-"))
        return start_local_cluster(home, nodes=nodes, cpus_per_node=1, port=free_port(), ray_defaults=ray_defaults)
    finally:
        if before is None:
            os.environ.pop(THRESHOLD_ENV, None)
        else:
            os.environ[THRESHOLD_ENV] = before


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant: cluster up, the job (phase ``job``), ``idle_s`` of nothing (phase ``idle``), cluster down."""
    threshold = VARIANTS[name]
    cluster = _start(threshold, args.nodes, ray_defaults=name == "ray_default")
    markers = [str(cluster.ray_temp_dir), str(cluster.home)]

    def sample() -> Sample:
        return take_sample(markers)

    out: dict[str, Any] = {"log_monitor_many_files_threshold": int(threshold), "raylets": len(cluster.node_ids)}
    try:
        with VigilClient(cluster.controller_url, token=cluster.admin_token, timeout=30) as client:
            load = {"submit": os.getloadavg()[0]}  # the machine's, this cluster included: how busy it was
            job = client.submit_job(job_spec(args.steps, args.ckpt))
            deadline = time.monotonic() + args.job_timeout_s

            def ended() -> bool:
                try:
                    return client.get_job(job.id).status.is_terminal() or time.monotonic() > deadline
                except UNREACHABLE as exc:  # a busy controller: ask again at the next reading
                    log.warning("%s: the controller did not answer (%s)", name, exc)
                    return time.monotonic() > deadline

            job_samples = sample_until(ended, sample, args.interval)
            final = client.get_job(job.id)
            load["job_end"] = os.getloadavg()[0]
            idle_end = time.monotonic() + args.idle_s
            idle_samples = sample_until(lambda: time.monotonic() >= idle_end, sample, args.interval)
            load["idle_end"] = os.getloadavg()[0]
            logs = client.job_logs(job.id).logs
        out.update(job=phase_summary(job_samples), idle=phase_summary(idle_samples),
                   rank_logs_forwarded=bool(RANK_LINE.search(logs)), rank_line_copies=rank_line_copies(logs),
                   job_status=final.status.value,
                   job_last_step=final.last_step, load_1m={k: round(v, 2) for k, v in load.items()})
        if final.status != JobStatus.SUCCEEDED:
            log.warning("%s: job %s ended %s: %s\n%s", name, job.id, final.status.value, final.message, logs[-3000:])
    finally:
        cluster.stop(discard_storage=True)
    return out


def _table(out: Mapping[str, Any]) -> str:
    """CPU seconds per second, by kind, of each variant and phase; then the ratios and Vigil's share."""
    cols = [(v, ph) for v in out["variants"] for ph in ("job", "idle")]
    lines = [f"{'CPU s/s':<22}" + "".join(f"{v + ' ' + ph:>18}" for v, ph in cols)]
    for kind in (*KINDS, None):
        cells = (_rate(out["variants"][v][ph], kind) for v, ph in cols)
        lines.append(f"{kind or 'total':<22}" + "".join(f"{'-' if c is None else f'{c:.3f}':>18}" for c in cells))
    lines.append("ratios (vigil / ray_default): " + ", ".join(f"{k} {v}" for k, v in out["ratios"].items()))
    lines.append(f"Vigil's share (vigil variant, job): {out['vigil_share']}")
    lines.append("rank logs forwarded: " + ", ".join(f"{v} {r.get('rank_logs_forwarded')}"
                                                      for v, r in out["variants"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vigil bench footprint", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--nodes", type=int, default=4, help="Worker raylets (one CPU each) beside the head (default 4).")
    p.add_argument("--idle-s", type=float, default=45.0, help="Seconds the cluster stays idle after the job (45).")
    p.add_argument("--interval", type=float, default=2.0, help="Seconds between two readings (2).")
    p.add_argument("--steps", type=int, default=60, help="The job's steps (60).")
    p.add_argument("--ckpt", type=int, default=20, help="The job checkpoints every this many steps (20).")
    p.add_argument("--job-timeout-s", type=float, default=300.0, help="Give up waiting for the job after this (300).")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}")
    t0 = time.time()
    variants = {name: run_variant(name, args) for name in names}
    vigil = variants.get("vigil")
    out = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "cpus": os.cpu_count(),
           "nodes": args.nodes, "interval_s": args.interval, "variants": variants, "ratios": ratios(variants),
           "vigil_share": vigil_share(vigil["job"], vigil["raylets"]) if vigil else None,
           "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
