"""The in-rank fault hook: the one-shot fault file, and a NaN loss injected in the real loop with the
rollback that follows (no checkpoint of the NaN state; a restart lands on the last good one and the
fault does not fire again).

Single process (world size 1), CPU torch, files under pytest's tmp_path; the loop test trains the
byte-level GPT for a few steps on the session's cached corpus.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from examples.gpt_pydoc.gpt_train import train
from vigil import checkpointing as checkpoint
from vigil.comm import CollectiveRecord
from vigil.contract.probe import wait_for
from vigil.contract.schemas import CheckpointSample, FaultSample, JobCreate, StepSample
from vigil.contract.settings import FAULT_FIRED_SUFFIX, fault_file_path
from vigil.faults import HANG_RANK, KILL_RANK, NAN_LOSS, SLOW_RANK, FaultHook
from vigil.sdk import RankContext


def _write(path: Path, body: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body if isinstance(body, str) else json.dumps(body))
    os.replace(tmp, path)


def test_fault_path_is_per_job_and_rank(tmp_path: Path) -> None:
    assert fault_file_path(tmp_path, "job-1", 3) == tmp_path / "faults" / "job-1" / "rank-3.json"
    assert ".." not in fault_file_path(tmp_path, "../../x", 0).relative_to(tmp_path).parts  # slugged


def test_no_file_no_fault(tmp_path: Path) -> None:
    hook = FaultHook(tmp_path / "rank-0.json")
    assert [hook.check(s) for s in range(1, 4)] == [None, None, None]
    assert FaultHook(None).check(1) is None


def test_fires_once_at_its_step_and_is_renamed(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    _write(path, {"kind": NAN_LOSS, "step": 5, "fault_id": 9})
    hook = FaultHook(path)
    assert hook.check(3) is None and hook.check(4) is None and path.exists()
    fault = hook.check(5)
    assert fault is not None and (fault.kind, fault.step, fault.fault_id) == (NAN_LOSS, 5, 9)
    assert not path.exists() and path.with_name(path.name + FAULT_FIRED_SUFFIX).exists()
    assert hook.check(6) is None
    # After a rollback to a step before 5, a fresh hook (a restarted rank) does not fire it again.
    restarted = FaultHook(path)
    assert [restarted.check(s) for s in (3, 4, 5, 6)] == [None, None, None, None]


def test_a_late_file_fires_at_once(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.json"
    hook = FaultHook(path)
    assert hook.check(10) is None
    _write(path, {"kind": NAN_LOSS, "step": 4})
    fault = hook.check(11)
    assert fault is not None and fault.step == 11 and fault.fault_id is None


def test_bad_or_unknown_files_are_ignored_until_they_change(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    hook = FaultHook(path)
    for body in ("{not json", {"kind": NAN_LOSS}, {"kind": NAN_LOSS, "step": "5"}, {"kind": "melt", "step": 1},
                 {"kind": NAN_LOSS, "step": 1, "fault_id": "x"}, {"kind": SLOW_RANK, "step": 1, "factor": 0.5},
                 {"kind": SLOW_RANK, "step": 1, "factor": True}, {"kind": SLOW_RANK, "step": 1, "factor": 1e9}):
        _write(path, body)
        assert hook.check(5) is None and path.exists(), body
    _write(path, {"kind": NAN_LOSS, "step": 2, "fault_id": 1})  # fixed: read again, fires
    assert hook.check(5) is not None


class Sink:
    def __init__(self) -> None:
        self.steps: list[StepSample] = []
        self.checkpoints: list[CheckpointSample] = []
        self.faults: list[FaultSample] = []

    def send_fault(self, sample: FaultSample) -> None:
        self.faults.append(sample)

    def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
        self.steps.append(sample)

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        self.checkpoints.append(sample)

    def close(self) -> None:
        pass


SPEC = JobCreate(
    name="nan",
    model={"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
    data={"max_bytes": 100_000, "seed": 2},
    optimizer={"kind": "adamw", "lr": 3e-3},
    steps=8,
    batch_size=4,
    eval_interval=0,
    checkpoint={"interval_steps": 2, "keep_last": 3},
)


def test_nan_loss_fault_is_real_is_never_checkpointed_and_rollback_does_not_refire(
    tmp_path: Path, corpus_cache: Path
) -> None:
    root, fault = tmp_path / "ckpt", fault_file_path(tmp_path / "run", "job-nan", 0)
    _write(fault, {"kind": NAN_LOSS, "step": 5, "fault_id": 1})
    sink = Sink()

    def ctx(sink: Sink) -> RankContext:
        return RankContext(rank=0, world_size=1, job_id="job-nan", telemetry=sink, checkpoint_root=root,
                           fault_file=fault, cache_dir=corpus_cache)

    first = train(SPEC, ctx(sink))
    assert first.faults == [5]
    # The rank told the controller the step the fault hit, and tagged every sample with its run attempt.
    assert [(f.step, f.fault_id, f.fault_kind) for f in sink.faults] == [(5, 1, NAN_LOSS)]
    assert {s.attempt for s in sink.steps} == {1}
    assert all(first.losses[s] is not None for s in range(1, 5))
    # The consequence is real: NaN gradients, NaN weights, every later loss NaN (None on the wire).
    assert [first.losses[s] for s in range(5, 9)] == [None, None, None, None]
    assert [s.loss for s in sink.steps][4:] == [None, None, None, None]
    assert first.model is not None and not all(bool(p.isfinite().all()) for p in first.model.parameters())
    # No checkpoint of a non-finite state: steps 6 and 8 were refused, 2 and 4 exist.
    assert first.checkpoints == [2, 4] and first.skipped_checkpoints == [6, 8]
    assert [s for s, _ in checkpoint.list_step_dirs(root)] == [2, 4]
    assert [(c.step, c.valid) for c in sink.checkpoints] == [(2, True), (4, True)]
    assert not fault.exists() and fault.with_name(fault.name + FAULT_FIRED_SUFFIX).exists()

    # Rollback: a restart restores step 4, the last good state, and the fault stays fired.
    second = Sink()
    again = train(SPEC, ctx(second))
    assert again.start_step == 5 and again.faults == []
    assert {s.attempt for s in second.steps} == {2}  # the restart is the next attempt: its steps 5+ are new samples
    assert all(v is not None and math.isfinite(v) for v in again.losses.values())
    assert again.checkpoints == [6, 8] and again.skipped_checkpoints == []
    assert abs(again.losses[5] - first.losses[4]) < 0.5  # continues from the checkpoint's loss level


@pytest.mark.timing
def test_slow_rank_fault_makes_the_compute_phase_factor_times_longer_until_reset(
    tmp_path: Path, corpus_cache: Path
) -> None:
    fault = fault_file_path(tmp_path / "run", "job-slow", 0)
    # A compute phase of tens of milliseconds, so that a sleep's overshoot (~0.1 ms) is noise.
    spec = JobCreate.model_validate({**SPEC.model_dump(), "steps": 24, "batch_size": 32,
                                     "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64},
                                     "checkpoint": {"interval_steps": 100, "keep_last": 1}})
    _write(fault, {"kind": SLOW_RANK, "step": 9, "factor": 3.0, "fault_id": 2})
    sink = Sink()

    class Reset(Sink):  # at step 16, the controller's clear: a new file with factor 1
        def send_step(self, sample: StepSample, records: Sequence[CollectiveRecord] = ()) -> None:
            sink.send_step(sample, records)
            if sample.step == 16:
                _write(fault, {"kind": SLOW_RANK, "step": 0, "factor": 1.0, "fault_id": 2})

    out = train(spec, RankContext(rank=0, world_size=1, job_id="job-slow", telemetry=Reset(),
                                  checkpoint_root=tmp_path / "ckpt", fault_file=fault, cache_dir=corpus_cache))
    assert out.faults == [9, 17]
    compute = {s.step: s.fwd_bwd_s for s in sink.steps}
    before = sorted(compute[s] for s in range(3, 9))[3]
    during = sorted(compute[s] for s in range(9, 17))[4]
    after = sorted(compute[s] for s in range(17, 25))[4]
    # 3x, or more on a busy host: a rank woken from its wait may queue for a core (seen: 3.3 to 6.6)
    assert 2.5 < during / before < 10
    assert after / before < 1.6


# A rank loop with no model (a fault acts before the step's work): it prints each step it completes.
_PROCESS_FAULT_LOOP = """
import sys
from pathlib import Path
from vigil import sdk
from vigil.telemetry import RankTelemetry

sock, fault, root = sys.argv[1:4]
with RankTelemetry(sock) as telemetry:
    ctx = sdk.RankContext(rank=0, world_size=1, job_id="job-proc", telemetry=telemetry,
                          checkpoint_root=Path(root), fault_file=Path(fault), async_checkpoints=False)
    session = sdk.init(ctx)
    for n in range(1, 9):
        with sdk.step(n) as s:
            s.report(loss=1.0)
        print(n, flush=True)
    sdk.close()
"""


def _run_rank_with_fault(tmp_path: Path, kind: str) -> tuple[subprocess.Popen[str], socket.socket, Path]:
    sock_path = tmp_path / "agent.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(sock_path))
    fault = fault_file_path(tmp_path / "run", "job-proc", 0)
    _write(fault, {"kind": kind, "step": 4, "fault_id": 11})
    proc = subprocess.Popen([sys.executable, "-c", _PROCESS_FAULT_LOOP, str(sock_path), str(fault), str(tmp_path / "ckpt")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, receiver, fault


def _received(receiver: socket.socket) -> list[dict[str, Any]]:
    receiver.setblocking(False)
    out: list[dict[str, Any]] = []
    while True:
        try:
            out.extend(json.loads(receiver.recv(1 << 20)))
        except BlockingIOError:
            return out


def test_kill_rank_in_the_rank_dies_at_exactly_its_step_and_says_so(tmp_path: Path) -> None:
    proc, receiver, fault = _run_rank_with_fault(tmp_path, KILL_RANK)
    with receiver:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        assert out.split() == ["1", "2", "3"]  # step 4 never ran
        got = _received(receiver)
    assert [(s["step"], s["fault_id"], s["fault_kind"]) for s in got if s["kind"] == "fault"] == [(4, 11, KILL_RANK)]
    assert [s["step"] for s in got if s["kind"] == "step"] == [1, 2, 3]
    assert not fault.exists() and fault.with_name(fault.name + FAULT_FIRED_SUFFIX).exists()  # never again


def test_hang_rank_in_the_rank_stops_at_exactly_its_step_until_continued(tmp_path: Path) -> None:
    proc, receiver, _ = _run_rank_with_fault(tmp_path, HANG_RANK)
    with receiver:
        try:
            p = psutil.Process(proc.pid)
            wait_for(lambda: p.status() == psutil.STATUS_STOPPED, 120, "the rank to stop itself", 0.05)
            hung = _received(receiver)
            assert [s["step"] for s in hung if s["kind"] == "step"] == [1, 2, 3]
            assert [(s["step"], s["fault_kind"]) for s in hung if s["kind"] == "fault"] == [(4, HANG_RANK)]
            os.kill(proc.pid, signal.SIGCONT)  # what the controller's clear (cont_pid) does
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0 and out.split() == [str(n) for n in range(1, 9)]
        assert [s["step"] for s in _received(receiver) if s["kind"] == "step"] == [4, 5, 6, 7, 8]
