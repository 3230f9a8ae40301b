"""Collective capture, the hang watcher and a rank's session on NCCL: torch's Flight Recorder read on a GPU.

Needs: a CUDA GPU for all but the first test (skipped without one, with that reason; CI's machine has
none, so these run on a lent GPU: tests/device/check_gpu.sh). One GPU holds one NCCL rank, so each NCCL
world here is one rank, in a fresh process (:func:`in_fresh_process`: 127.0.0.1, a free port, under a
timeout), because torch sizes its recorders from ``TORCH_FR_BUFFER_SIZE`` when a process makes its
first process group. The gloo counterparts (two ranks, CPU) are in test_capture.py; the assertions mirror
them. The first test needs nothing: which recorder :func:`vigil.capture.dump_fr` reads, on fakes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.vigil.telemetry_sink import Sink
from vigil import capture
from vigil import sdk as vigil
from vigil.capture import FR_BUFFER_ENV, SEQ_BASE, CollectiveCapture, Entry
from vigil.contract.probe import free_port
from vigil.contract.schemas import CAPTURED_TAG, JobCreate, ProgressSample
from vigil.rank.watch import Watcher, progress

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
TIMEOUT = 120.0
FR_ON = {FR_BUFFER_ENV: "500"}
"""The recorder as Vigil's driver turns it on for its ranks (vigil/driver.py): no NCCL timing."""
TIMED = {**FR_ON, "TORCH_NCCL_ENABLE_TIMING": "1"}
"""And NCCL's CUDA-event timing, which gives each entry a ``duration_ms``."""
SLEEP_CYCLES = 1_000_000_000
"""A GPU spin of about half a second (more at idle clocks): an all-reduce queued behind it stays in flight."""


# -- a fresh process per NCCL world --------------------------------------------------------------------


def _rank(fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], backend: str, results: Any) -> None:
    """The child: the recorder's environment first, then a world of one (``backend``: nccl on cuda:0), then fn."""
    os.environ.update(env)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        device = torch.device("cuda", 0) if backend == "nccl" else None
        dist.init_process_group(backend, rank=0, world_size=1, device_id=device)
        try:
            results.put(("ok", fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - whatever the rank raises goes back to the test
        results.put(("error", traceback.format_exc()))


def in_fresh_process(fn: Callable[..., Any], *args: Any, env: dict[str, str], backend: str = "nccl") -> Any:
    """``fn(*args)`` (module-level, picklable result) on a world of one in a spawned process; fails the test
    with the child's traceback, or when it dies or overruns :data:`TIMEOUT`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(fn, args, env, backend, results), daemon=True)
    proc.start()
    deadline = time.monotonic() + TIMEOUT
    got: tuple[str, Any] | None = None
    try:
        while got is None:
            try:
                got = results.get(timeout=0.5)
            except queue.Empty:
                if proc.is_alive() and time.monotonic() < deadline:
                    continue
                try:
                    got = results.get(timeout=2.0)  # it may have reported just before it ended
                except queue.Empty:
                    pytest.fail(f"{fn.__name__}: no result (exit code {proc.exitcode}, limit {TIMEOUT:.0f} s)")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    status, payload = got
    if status != "ok":
        pytest.fail(f"{fn.__name__} raised in its rank:\n{payload}")
    return payload


# -- which recorder is read (no GPU needed) ------------------------------------------------------------


def test_dump_fr_reads_nccls_own_recorder_when_the_world_is_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._C._distributed_c10d as c10d

    def fake(name: str) -> Callable[..., bytes]:
        return lambda **kw: pickle.dumps({"entries": [{"profiling_name": name}], "pg_status": {}})

    monkeypatch.setattr(c10d, "_dump_fr_trace", fake("gloo:all_reduce"), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", fake("nccl:all_reduce"), raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, read in [("nccl", "nccl:all_reduce"), ("cpu:gloo,cuda:nccl", "nccl:all_reduce"), ("gloo", "gloo:all_reduce")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert capture.dump_fr()["entries"][0]["profiling_name"] == read, backend
    # The group destroyed (the code's last line): the next read stays on the recorder read before.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    capture.dump_fr()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert capture.dump_fr()["entries"][0]["profiling_name"] == "nccl:all_reduce"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    capture.dump_fr()  # back to gloo for whatever runs next in this process


# -- raw collectives -----------------------------------------------------------------------------------


def _nccl_dump() -> dict[str, Any]:
    import torch._C._distributed_c10d as c10d

    return pickle.loads(c10d._dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))


def _wait_done(dump: Callable[[], dict[str, Any]], n: int, timeout: float = 10.0) -> None:
    """Until the recorder's newest ``n`` entries are done (NCCL's watchdog retires them after the GPU)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = dump().get("entries", [])[-n:]
        if len(newest) == n and all(e.get("retired") or e.get("state") == "completed" for e in newest):
            return
        time.sleep(0.05)


def _row(e: Entry) -> tuple[Any, ...]:
    return (e.op, e.group, e.seq, e.key, e.payload_bytes, e.elements, e.done, e.duration_s)


def _collectives(dev: str) -> dict[str, Any]:
    """all_reduce (1000 fp32), all_gather (256 bf16) and broadcast (64 int64) on ``dev``; then what the
    capture makes of the recorder Vigil reads, and of NCCL's own."""
    import torch._C._distributed_c10d as c10d

    x = torch.ones(1000, device=dev)
    dist.all_reduce(x)
    shard = torch.full((256,), 2.0, device=dev, dtype=torch.bfloat16)
    gathered = torch.empty(256 * dist.get_world_size(), device=dev, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, shard)
    b = torch.arange(64, device=dev)
    dist.broadcast(b, src=0)
    if dev != "cpu":
        torch.cuda.synchronize()
    nccl = hasattr(c10d, "_dump_nccl_trace") and dev != "cpu"
    _wait_done(_nccl_dump if nccl else capture.dump_fr, 3)
    names = {"_dump_fr_trace": [e["profiling_name"] for e in pickle.loads(c10d._dump_fr_trace()).get("entries", [])]}
    if nccl:
        names["_dump_nccl_trace"] = [e["profiling_name"] for e in _nccl_dump().get("entries", [])]
    return {
        "available": capture.fr_available(),
        "vigil": [_row(e) for e in CollectiveCapture(1).read()],
        "nccl": [_row(e) for e in CollectiveCapture(1, dump=_nccl_dump).read()] if nccl else None,
        "status": (_nccl_dump() if nccl else capture.dump_fr()).get("pg_status") or {},
        "names": names,
        "results": (float(x.sum()), float(gathered.float().sum()), int(b.sum())),
    }


@pytest.fixture(scope="module")
def collectives() -> dict[str, Any]:
    return in_fresh_process(_collectives, "cuda", env=TIMED)


def _check_rows(rows: list[tuple[Any, ...]], *, timed: bool) -> None:
    assert len(rows) >= 3, rows
    rows = rows[-3:]
    assert [(op, group) for op, group, *_ in rows] == [("all_reduce", "world"), ("all_gather", "world"),
                                                       ("broadcast", "world")], rows
    assert [(payload, elements) for *_, payload, elements, _, _ in rows] == [(4000, 1000), (512, 256), (512, 64)]
    seqs = [seq for _, _, seq, *_ in rows]
    assert seqs == list(range(seqs[0], seqs[0] + 3)) and seqs[0] >= 1, seqs  # the group's own numbering
    assert [key for _, _, _, key, *_ in rows] == [SEQ_BASE + s for s in seqs]  # the world is pg 0
    assert all(done for *_, done, _ in rows), rows  # completed on the GPU
    if timed:
        assert all(d is not None and 0.0 <= d < 10.0 for *_, d in rows), rows  # NCCL's CUDA-event durations


@needs_cuda
def test_nccl_entries_name_op_sizes_seq_and_completion(collectives: dict[str, Any]) -> None:
    """The format NCCL's recorder writes, as the capture turns it into entries (read through NCCL's own dump)."""
    assert collectives["nccl"] is not None, "torch has no _dump_nccl_trace"
    _check_rows(collectives["nccl"], timed=True)
    world = collectives["status"].get("0") or collectives["status"].get(0)
    last = collectives["nccl"][-1][2]
    assert world is not None and int(world["last_enqueued_collective"]) == int(world["last_completed_collective"]) == last
    assert collectives["results"] == (1000.0, 512.0, sum(range(64)))


@needs_cuda
def test_vigil_reads_the_recorder_that_holds_the_nccl_collectives(collectives: dict[str, Any]) -> None:
    """What the session and the watcher read (vigil.capture.dump_fr) holds them."""
    assert collectives["available"], "fr_available() is False with TORCH_FR_BUFFER_SIZE set"
    assert collectives["vigil"] == collectives["nccl"], (
        f"dump_fr() found {collectives['vigil']}, NCCL's recorder {collectives['nccl']}; "
        f"profiling names per torch dump: {collectives['names']}")


# -- the watcher: a collective in flight on the GPU ----------------------------------------------------


def _sample(state: dict[str, Any], idle_s: float) -> ProgressSample:
    return ProgressSample(job_id="job-cuda", rank=0, attempt=1, ts=time.time(), step=3, idle_s=idle_s, **state)


def _in_flight(dev: str) -> dict[str, Any]:
    """An all-reduce queued behind a GPU spin: what a stalled rank's watcher sends meanwhile, and after."""
    x = torch.ones(1 << 20, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: NCCL's stream waits for it before the all-reduce
    dist.all_reduce(x)  # returns once enqueued
    sent: list[ProgressSample] = []
    watcher = Watcher(lambda: (30.0, 1.0), _sample, sent.append, exclude=set(), world_size=1)
    stalled = watcher.check()
    torch.cuda.synchronize()
    _wait_done(capture.dump_fr, 1)
    after = progress(capture.dump_fr(), set(), 1)
    return {"stalled": stalled, "sent": [s.model_dump(mode="json") for s in sent],
            "after": {"groups": [g.model_dump(mode="json") for g in after["groups"]],
                      "in_flight": [r.model_dump(mode="json") for r in after["in_flight"]],
                      "last_done": after["last_done"].model_dump(mode="json") if after["last_done"] else None}}


@needs_cuda
def test_watcher_sees_the_nccl_collective_a_stalled_rank_waits_in() -> None:
    out = in_fresh_process(_in_flight, "cuda", env=FR_ON)
    assert out["stalled"] and len(out["sent"]) == 1
    sent = out["sent"][0]
    assert sent["in_flight"] and sent["in_flight"][-1]["op"] == "all_reduce" and sent["in_flight"][-1]["group"] == "world"
    world = {g["group"]: g for g in sent["groups"]}["world"]
    assert world["last_enqueued"] > world["last_completed"], sent["groups"]  # entered, not done
    after = out["after"]
    assert after["in_flight"] == [] and after["last_done"]["op"] == "all_reduce", after
    world = {g["group"]: g for g in after["groups"]}["world"]
    assert world["last_enqueued"] == world["last_completed"] == after["last_done"]["seq"]


# -- a session: plain DDP on the GPU, captured per step, checkpointed and restored ---------------------


def _model(dev: str) -> nn.Module:
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(dev))


def _values(model: nn.Module) -> list[float]:
    """The parameters as plain floats (what crosses back to the test: no tensors in shared memory)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()


def _ddp_session(dev: str, root: str) -> dict[str, Any]:
    """A user's plain DDP loop on ``dev`` (torch's DDP and AdamW, an all-reduce of its own on a group of its
    own) with Vigil's init / step / report / checkpoint; then a second start restores it."""
    sink, seen = Sink(), {}
    spec = JobCreate.model_validate({"name": "cuda", "steps": 5, "checkpoint": {"interval_steps": 5}})

    def train(config: dict[str, Any]) -> None:
        seen["device"] = str(vigil.init().device)
        torch.manual_seed(0)
        model = _model(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mine = dist.new_group([0])
        x = torch.randn(32, 16, device=dev)
        for step in range(1, 6):
            with vigil.step(step):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total, group=mine)
                vigil.report(loss=float(total), tokens=32)
            vigil.checkpoint(step, model=model, optimizer=opt)
        seen["params"] = _values(model)

    def resume(config: dict[str, Any]) -> None:
        vigil.init()
        torch.manual_seed(1)
        model = _model(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen["restored"] = vigil.restore(model=model, optimizer=opt)
        seen["restored_params"] = _values(model)
        seen["moments"] = sorted({str(s["exp_avg"].device) for s in opt.state.values()})

    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-cuda", telemetry=sink, checkpoint_root=Path(root))
    summary = vigil.run(train, ctx, spec)
    vigil.run(resume, vigil.RankContext(rank=0, world_size=1, job_id="job-cuda", checkpoint_root=Path(root)), spec)
    return {
        **seen, "checkpoints": summary.checkpoints, "losses": [summary.losses[s] for s in range(1, 6)],
        "steps": [(s.step, s.comm_s) for s in sink.steps],
        "records": [(r.step, r.op, r.group, r.tag, r.payload_bytes, r.wire_bytes, r.duration_s)
                    for recs in sink.records for r in recs],
    }


@needs_cuda
def test_plain_ddp_on_nccl_is_captured_per_step_and_checkpoints_round_trip(tmp_path: Path) -> None:
    out = in_fresh_process(_ddp_session, "cuda", str(tmp_path / "ckpt"), env=FR_ON)
    assert out["device"] == "cuda:0"
    assert [s for s, _ in out["steps"]] == [1, 2, 3, 4, 5]
    assert all(c is not None and c > 0 for _, c in out["steps"]), out["steps"]
    recs = out["records"]
    assert recs and all(r[3] == CAPTURED_TAG for r in recs)
    for step in range(1, 6):
        ops = {(op, group) for s, op, group, *_ in recs if s == step}
        # DDP's gradient bucket on the world, and the user's own all-reduce on its own group
        assert ("all_reduce", "world") in ops and any(op == "all_reduce" and g.startswith("pg") for op, g in ops), ops
    params = 16 * 32 + 32 + 32 + 1
    grads = [r for r in recs if r[0] >= 1 and r[2] == "world" and r[1] == "all_reduce"]
    assert all(p == params * 4 and w == 0 for *_, p, w, _d in grads), grads  # one rank sends nothing
    assert all(d >= 0 for *_, d in recs)
    assert all(loss is not None for loss in out["losses"]) and out["losses"][-1] < out["losses"][0]
    # The checkpoint of step 5 (an NCCL world of one: DCP on the training group) comes back on the GPU.
    assert out["checkpoints"] == [5] and out["restored"] == 5
    assert out["restored_params"] == out["params"]
    assert out["moments"] == ["cuda:0"]
