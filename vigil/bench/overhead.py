"""Step time of the same training job with rank telemetry on and off, interleaved in one run.

``vigil bench overhead [--json] [--steps 1000] [--block 5] [--ranks 2]``

The bundled GPT example on the rank API (:mod:`examples.gpt_pydoc.gpt_train`, DDP AdamW on the demo's byte-level GPT, gloo) runs
on ``--ranks`` processes of this machine next to a real ``vigil agent`` process listening on the
node socket (its controller is unreachable, so it spools: the rank side is what is measured). The
telemetry sink alternates by blocks of ``--block`` steps: on (:class:`vigil.telemetry.RankTelemetry`,
one StepSample and one CollectiveSample per collective per step, as in production) and off (a
no-op, what ``VIGIL_TELEMETRY=off`` gives). Alternating blocks inside one run means both modes
see the same machine load, the same data and the same model state drift; the first two blocks
are warm-up and left out.

A step's time is rank 0's wall time from one step's telemetry call to the next one's, so it
includes everything the loop does for the step, the telemetry send itself included (the loop's
own ``step_time_s`` stops before the send). Reported: the median per mode, and as ``ratio`` the
median over adjacent (on, off) block pairs of their ratio (see :func:`summarize`), plus the time
rank 0 spent inside the telemetry call itself (``send_s_per_step``), which the load of a shared
machine barely disturbs.

JSON (``--json``): ``{"step_time_on_s", "step_time_off_s", "ratio", "ratio_of_medians", "block_pairs",
"send_s_per_step", "steps", "block", "ranks", "samples_sent", "samples_dropped", "mean_on_s", "mean_off_s"}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPEC: dict[str, Any] = {
    "name": "bench-overhead",
    "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
    "data": {"corpus": "pydoc", "max_bytes": 2_000_000, "seed": 0},
    "optimizer": {"kind": "adamw", "lr": 0.003},
    "scaling": {"min_workers": 2, "max_workers": 2},
    "batch_size": 16,
    "lr_schedule": {"kind": "constant", "warmup_steps": 0},
}


class BlockSink:
    """Telemetry on for even blocks of steps, off (nothing sent) for odd ones; remembers when each step's call came."""

    def __init__(self, inner: Any, block: int) -> None:
        self.inner = inner
        self.block = block
        self.marks: list[tuple[int, float, bool]] = []
        self.send_s: list[float] = []

    def on(self, step: int) -> bool:
        return ((step - 1) // self.block) % 2 == 0

    def send_step(self, sample: Any, records: Sequence[Any] = ()) -> None:
        on = self.on(sample.step)
        self.marks.append((sample.step, time.perf_counter(), on))
        if on:
            t = time.perf_counter()
            self.inner.send_step(sample, records)
            self.send_s.append(time.perf_counter() - t)

    def send_checkpoint(self, sample: Any) -> None:
        self.inner.send_checkpoint(sample)

    def close(self) -> None:
        self.inner.close()


def _rank(rank: int, world_size: int, spec: dict[str, Any], sock: str, block: int) -> dict[str, Any]:
    from controller.schemas import JobCreate
    from examples.gpt_pydoc.gpt_train import train
    from vigil.sdk import RankContext
    from vigil.telemetry import RankTelemetry

    sink = BlockSink(RankTelemetry(sock), block)
    try:
        train(JobCreate.model_validate(spec), RankContext(rank=rank, world_size=world_size, job_id="job_overhead",
                                                          telemetry=sink))
    finally:
        sink.close()
    return {"marks": sink.marks, "send_s": sink.send_s, "sent": sink.inner.sent_total,
            "dropped": sink.inner.dropped_total}


def _wait_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the agent exited before binding its socket")
        if path.exists():
            return
        time.sleep(0.1)
    raise TimeoutError(f"agent socket {path} did not appear")


def summarize(marks: list[tuple[int, float, bool]], block: int) -> dict[str, float]:
    """Step times per mode from rank 0's (step, time, on) marks, the two warm-up blocks left out.

    ``ratio``: the median, over adjacent (on, off) block pairs, of the ratio of the two blocks'
    median step times. Pairing neighbours cancels the load of the shared machine, which drifts on
    a scale of seconds; a median of ratios ignores the pairs a burst of someone else's work hit.
    """
    per: dict[bool, list[float]] = {True: [], False: []}
    blocks: dict[int, list[float]] = {}
    for (step, t, on), (_, t_next, _) in itertools.pairwise(marks):
        if step > 2 * block:
            per[on].append(t_next - t)
            blocks.setdefault((step - 1) // block, []).append(t_next - t)
    if not per[True] or not per[False]:
        raise ValueError("not enough steps for both modes after the warm-up: raise --steps")
    ratios = [statistics.median(blocks[b]) / statistics.median(blocks[b + 1])
              for b in sorted(blocks) if b % 2 == 0 and b + 1 in blocks]
    return {"step_time_on_s": statistics.median(per[True]), "step_time_off_s": statistics.median(per[False]),
            "mean_on_s": statistics.fmean(per[True]), "mean_off_s": statistics.fmean(per[False]),
            "ratio": statistics.median(ratios), "pairs": len(ratios)}


def run(steps: int, block: int, ranks: int, timeout: float) -> dict[str, Any]:
    from vigil.bench.ranks import run_ranks

    spec = {**SPEC, "steps": steps, "scaling": {"min_workers": ranks, "max_workers": ranks}}
    tmp = Path(tempfile.mkdtemp(prefix="vob-", dir="/tmp"))  # short: unix socket paths are limited
    sock = tmp / "agent.sock"
    with socket.socket() as s:  # a port nobody listens on: the agent spools what it receives
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "--node-id", "bench-node", "--controller", dead_url, "--socket", str(sock),
         "--spool-dir", str(tmp / "spool"), "--run-dir", str(tmp), "--log-level", "ERROR",
         "--token", "unused-no-controller-listens"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        _wait_socket(sock, agent)
        results = run_ranks(ranks, _rank, spec, str(sock), block, timeout=timeout)
    finally:
        agent.terminate()
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(5)
        shutil.rmtree(tmp, ignore_errors=True)
    out = summarize(results[0]["marks"], block)
    return {
        "step_time_on_s": round(out["step_time_on_s"], 6), "step_time_off_s": round(out["step_time_off_s"], 6),
        "ratio": round(out["ratio"], 4), "ratio_of_medians": round(out["step_time_on_s"] / out["step_time_off_s"], 4),
        "block_pairs": out["pairs"], "send_s_per_step": round(statistics.fmean(results[0]["send_s"]), 7),
        "steps": steps, "block": block,
        "ranks": ranks, "samples_sent": sum(r["sent"] for r in results),
        "samples_dropped": sum(r["dropped"] for r in results),
        "mean_on_s": round(out["mean_on_s"], 6), "mean_off_s": round(out["mean_off_s"], 6),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vigil bench overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a line of text")
    ap.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    ap.add_argument("--block", type=int, default=5, help="steps per on/off block (default 5)")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    args = ap.parse_args(argv)
    if args.block < 1 or args.steps < 6 * args.block:
        ap.error("need --block >= 1 and --steps >= 6 x --block (two warm-up blocks, then both modes twice)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    result = run(args.steps, args.block, args.ranks, args.timeout)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"telemetry on {result['step_time_on_s'] * 1e3:.2f} ms/step, off {result['step_time_off_s'] * 1e3:.2f} "
              f"ms/step: ratio {result['ratio']:.4f} ({result['samples_sent']} samples sent, "
              f"{result['samples_dropped']} dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
