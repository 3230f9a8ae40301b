"""What a step of ``recovery.policy: live`` costs beyond its all-reduce, measured without a cluster.

``vigil bench live-step [--json] [--steps 300] [--elements 120576] [--repeats 3] [--variants ...]``

Two processes of this machine run the same loop of ``--steps`` steps, each step one SUM all-reduce of
``--elements`` floats (default: the gradient of ``vigil bench recovery``'s model), in four ways:

* ``gloo``: a plain gloo process group (``dist.all_reduce``): what a step's communication costs under
  ``evict_restart``, the baseline;
* ``live``: Vigil's live replica as a job runs it (:class:`vigil.live.LiveReplica`: a lighthouse, a torchft
  manager per rank; a quorum every 10 steps, ``recovery.quorum_every_steps``'s default; the all-reduce
  through :class:`vigil.live.LiveComm`; the step committed by :func:`vigil.live.commit_step`);
* ``live_every_step``: the same with a quorum at every step (``quorum_every_steps: 1``);
* ``torchft``: the same replica, but the all-reduce through torchft's ``Manager.allreduce`` and the commit
  through ``Manager.should_commit`` (what live did before 2026-11-29), for comparison in the same run.

The variants alternate, ``--repeats`` times; each keeps its fastest mean (this machine is shared). A step is
timed from the quorum (when due) to the commit; the first 20 are warm-up. Reported per variant the mean and
median step in ms, and ``overhead_ms`` / ``ratio``: each variant's mean over ``gloo``'s. The whole job's
figure (steps with compute, checkpoints, Ray) is ``steady_step_ratio`` of ``vigil bench recovery``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

WARMUP = 20
VARIANTS = ("gloo", "live", "live_every_step", "torchft")
DEFAULT_ELEMENTS = 120_576
"""The gradient of ``vigil bench recovery``'s model (482,304 bytes a step's all-reduce carries)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo(rank: int, port: int, steps: int, elements: int) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(elements)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        t.fill_(1.0)
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return times


def _live(rank: int, lighthouse: str, steps: int, elements: int, variant: str) -> list[float]:
    import torch
    from torch.distributed import ReduceOp

    from vigil.live import LiveReplica

    every = 1 if variant == "live_every_step" else 10
    key = hashlib.sha256(lighthouse.encode()).hexdigest()  # the same in both processes (a bench: no secret needed)
    r = LiveReplica(rank=rank, world_size=2, min_replicas=2, lighthouse=lighthouse, host="127.0.0.1",
                    quorum_every=every, replica_prefix="bench_", heal_key=key)
    try:
        t = torch.zeros(elements)
        r.restore(lambda: 0)
        times = []
        for n in range(1, steps + 1):
            t0 = time.perf_counter()
            r.start_step(n)
            t.fill_(1.0)
            if variant == "torchft":
                r.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
                if not r.manager.should_commit():
                    raise RuntimeError(f"step {n} did not commit")
            else:
                r.comm.set_step(n)
                r.comm.all_reduce(t)
                r.end_step()
            times.append(time.perf_counter() - t0)
        if r.manager.num_participants() != 2:
            raise RuntimeError("the replicas did not run together")
        return times
    finally:
        r.close()


def _worker(rank: int, variant: str, where: str, steps: int, elements: int, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        times = (_gloo(rank, int(where), steps, elements) if variant == "gloo"
                 else _live(rank, where, steps, elements, variant))
        out.put((rank, times[WARMUP:], None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put((rank, None, f"{type(e).__name__}: {e}"))


def run_variant(variant: str, steps: int, elements: int) -> dict[str, float]:
    """One run of ``variant`` on two processes: rank 0's mean and median step, in ms."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    server = None
    if variant == "gloo":
        where = str(_free_port())
    else:
        from vigil.live import start_lighthouse

        server = start_lighthouse(2, bind="127.0.0.1:0")
        where = server.address()
    procs = [ctx.Process(target=_worker, args=(rank, variant, where, steps, elements, out)) for rank in (0, 1)]
    try:
        for p in procs:
            p.start()
        results = {rank: (times, err) for rank, times, err in (out.get(timeout=300) for _ in procs)}
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if server is not None:
            server.shutdown()
    errors = [err for _, err in results.values() if err]
    if errors:
        raise RuntimeError(f"{variant}: {errors[0]}")
    times = results[0][0]
    return {"mean_ms": round(statistics.mean(times) * 1e3, 3), "median_ms": round(statistics.median(times) * 1e3, 3)}


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each variant's fastest run (by mean), and its mean over the baseline's (``gloo``) when that ran."""
    best = {v: min(rs, key=lambda r: r["mean_ms"]) for v, rs in runs.items()}
    variants = {v: {**b, "means_ms": [r["mean_ms"] for r in runs[v]]} for v, b in best.items()}
    out: dict[str, Any] = {"variants": variants}
    base = best.get("gloo")
    if base:
        out["overhead_ms"] = {v: round(b["mean_ms"] - base["mean_ms"], 3) for v, b in best.items() if v != "gloo"}
        out["ratio"] = {v: round(b["mean_ms"] / base["mean_ms"], 3) for v, b in best.items() if v != "gloo"}
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vigil bench live-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--steps", type=int, default=300, help=f"Steps per run (the first {WARMUP} are warm-up).")
    p.add_argument("--elements", type=int, default=DEFAULT_ELEMENTS, help="Floats all-reduced per step.")
    p.add_argument("--repeats", type=int, default=3, help="Runs of each variant, alternating.")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated, of {', '.join(VARIANTS)}.")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.steps <= WARMUP:
        p.error(f"--steps: must be more than the {WARMUP} warm-up steps, got {args.steps}")
    if args.elements < 1 or args.repeats < 1:
        p.error("--elements and --repeats: must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("RUST_LOG", "warn")
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    for _ in range(args.repeats):
        for v in args.variants:
            runs[v].append(run_variant(v, args.steps, args.elements))
    out = {"steps": args.steps, "elements": args.elements, "repeats": args.repeats, **summarize(runs),
           "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        print(json.dumps(out))
    else:
        for v, r in out["variants"].items():
            extra = "" if v == "gloo" or "ratio" not in out else f"  (x{out['ratio'][v]}, +{out['overhead_ms'][v]} ms)"
            print(f"{v:>16}: mean {r['mean_ms']:.2f} ms, median {r['median_ms']:.2f} ms{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
