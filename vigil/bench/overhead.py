"""Step time of the same training job with rank telemetry on and off, interleaved in one run.

``vigil bench overhead [--json] [--steps 1000] [--block 5] [--ranks 2] [--mode telemetry|captured]``

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

``--mode captured``: the same alternation for the capture of code that keeps torch's own DDP and optimizer
(:mod:`examples.ddp_plain`, whose collectives Vigil reads from torch's Flight Recorder, :mod:`vigil.capture`):
in "on" blocks the session reads the recorder and sends the held steps with their collectives, in "off"
blocks it sends each step at once without collectives (the recorder records in both: its size is set
before the process group exists). Reported beside the ratio, ``mode: "captured"``, the CPU the capture
took on rank 0 (``capture_cpu_us_per_step``, ``capture_cpu_us_per_collective``: thread CPU time inside the
recorder's reads and the assignment of its entries to steps, over all steps and all collectives read: the
recorder records in "off" blocks too and the next read takes their entries) and ``recorder_reads``. A
read costs about 10 us per entry the ring *holds*, so the per-collective cost falls to its steady state
(~1.25 entries' worth, :data:`vigil.capture.READ_FILL`) only over runs of many reads: use
``--steps 3000`` or more.
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
    from examples.gpt_pydoc.gpt_train import train
    from vigil.contract.schemas import JobCreate
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


def _recorder_on(rank: int) -> None:
    """Each rank's process, before its process group: the Flight Recorder records."""
    from vigil.capture import FR_BUFFER_DEFAULT, FR_BUFFER_ENV

    os.environ.setdefault(FR_BUFFER_ENV, str(FR_BUFFER_DEFAULT))


def _captured_rank(rank: int, world_size: int, steps: int, sock: str, block: int) -> dict[str, Any]:
    """The DDP example under a session, capture on and off in alternate blocks of its steps (rank 0's
    step boundaries marked by an optimizer-step hook of this benchmark)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from examples.ddp_plain.train import train_func
    from vigil import sdk
    from vigil.contract.schemas import JobCreate
    from vigil.sdk import RankContext
    from vigil.telemetry import RankTelemetry

    marks: list[tuple[int, float, bool]] = []
    state: dict[str, Any] = {"n": 0, "saved": None, "on_steps": 0, "cpu_on": 0.0}

    def boundary(optimizer: Any, args: Any, kwargs: Any) -> None:
        session = sdk._current
        if session is None:
            return
        state["n"] += 1
        n = state["n"]
        on = ((n - 1) // block) % 2 == 0
        marks.append((n, time.perf_counter(), on))
        if state["saved"] is None:
            state["saved"] = session.capture
        state["on_steps"] += on
        nxt = (n // block) % 2 == 0  # the mode of the next step
        if nxt != on:  # the steps an "on" block held go out at the capture's next read, as they would
            session.capture = state["saved"] if nxt else None

    hook = register_optimizer_step_post_hook(boundary)
    telemetry = RankTelemetry(sock)
    spec = JobCreate.model_validate({"name": "bench-captured", "steps": steps, "checkpoint": {"interval_steps": 0},
                                     "scaling": {"min_workers": world_size, "max_workers": world_size}})
    session_box: list[Any] = []
    try:
        def run(config: dict[str, Any]) -> None:
            session_box.append(sdk.get_session())
            train_func(config)

        sdk.run(run, RankContext(rank=rank, world_size=world_size, job_id="job_overhead", telemetry=telemetry), spec,
                {"width": 128, "batch_size": 64})
    finally:
        hook.remove()
        telemetry.close()
    session = session_box[0]
    cap = state["saved"]
    return {"marks": marks, "send_s": [0.0], "sent": telemetry.sent_total, "dropped": telemetry.dropped_total,
            "ship_cpu_s": session.ship_cpu_s, "reads": cap.reads if cap is not None else 0,
            "captured": cap.captured if cap is not None else 0, "on_steps": state["on_steps"]}


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


def run(steps: int, block: int, ranks: int, timeout: float, mode: str = "telemetry") -> dict[str, Any]:
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
        if mode == "captured":
            results = run_ranks(ranks, _captured_rank, steps, str(sock), block, timeout=timeout, setup=_recorder_on)
        else:
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
    extra: dict[str, Any] = {"mode": mode}
    if mode == "captured":
        r0 = results[0]
        # Every step's collectives are read (the recorder records in "off" blocks too; the next read takes
        # them): the reads' CPU is spread over all steps.
        extra |= {"capture_cpu_us_per_step": round(r0["ship_cpu_s"] / max(1, steps) * 1e6, 1),
                  "capture_cpu_us_per_collective": round(r0["ship_cpu_s"] / max(1, r0["captured"]) * 1e6, 2),
                  "collectives_captured": r0["captured"], "recorder_reads": r0["reads"]}
    return extra | {
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
    ap.add_argument("--mode", choices=("telemetry", "captured"), default="telemetry",
                    help="telemetry: the GPT example's telemetry on/off; captured: the plain DDP example's "
                    "collective capture (torch's Flight Recorder) on/off")
    args = ap.parse_args(argv)
    if args.block < 1 or args.steps < 6 * args.block:
        ap.error("need --block >= 1 and --steps >= 6 x --block (two warm-up blocks, then both modes twice)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    result = run(args.steps, args.block, args.ranks, args.timeout, args.mode)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"telemetry on {result['step_time_on_s'] * 1e3:.2f} ms/step, off {result['step_time_off_s'] * 1e3:.2f} "
              f"ms/step: ratio {result['ratio']:.4f} ({result['samples_sent']} samples sent, "
              f"{result['samples_dropped']} dropped)"
              + (f"; capture {result['capture_cpu_us_per_step']} us CPU/step" if args.mode == "captured" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
