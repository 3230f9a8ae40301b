"""Rank telemetry over a real unix datagram socket: delivery, never blocking, drop accounting, splitting.

Needs a Linux-like OS with AF_UNIX datagram sockets; sockets live in short /tmp paths (a unix
socket path must fit in 108 bytes, which pytest's tmp_path may exceed).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from controller.schemas import CheckpointSample, CollectiveSample, RankSample, StepSample
from trainer.comm import CollectiveRecord
from trainer.telemetry import MAX_DATAGRAM_BYTES, RankTelemetry, encode, pack

SAMPLES = TypeAdapter(list[RankSample])


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vt-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _listener(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2.0)
    return s


def _recv_all(s: socket.socket) -> list[list[dict]]:
    """Every datagram waiting on ``s``, parsed (each one a JSON array)."""
    out = []
    s.setblocking(False)
    try:
        while True:
            out.append(json.loads(s.recv(1 << 17)))
    except BlockingIOError:
        pass
    finally:
        s.settimeout(2.0)
    return out


def _step(step: int, loss: float | None = 1.0) -> StepSample:
    return StepSample(job_id="job", rank=1, world_size=2, step=step, ts=time.time(), loss=loss, step_time_s=0.1)


def _record(step: int, seq: int, tag: str = "grads") -> CollectiveRecord:
    return CollectiveRecord(step, seq, "all_reduce", "world", tag, 400, 400, 100, 0.002, time.time())


def test_listener_receives_step_and_collective_samples(sock_dir: Path) -> None:
    path = sock_dir / "a.sock"
    rx = _listener(path)
    with RankTelemetry(path) as tx:
        tx.send_step(_step(5), [_record(5, 0), _record(5, 1, "weights")])
    items = SAMPLES.validate_python(json.loads(rx.recv(1 << 17)))
    assert [type(i) for i in items] == [StepSample, CollectiveSample, CollectiveSample]
    step, _, c1 = items
    assert isinstance(step, StepSample) and step.step == 5 and step.rank == 1 and step.dropped == 0
    assert isinstance(c1, CollectiveSample)
    assert (c1.job_id, c1.rank, c1.step, c1.seq, c1.op, c1.tag) == ("job", 1, 5, 1, "all_reduce", "weights")
    assert (c1.payload_bytes, c1.wire_bytes, c1.elements) == (400, 400, 100)


def test_checkpoint_samples_go_out_as_the_wire_schema(sock_dir: Path) -> None:
    path = sock_dir / "a.sock"
    rx = _listener(path)
    sample = CheckpointSample(job_id="job", step=40, ts=time.time(), path="/s/job/checkpoints/step-00000040",
                              valid=True, world_size=4, files=5, bytes=12345, manifest_sha256="ab" * 32, loss=2.5)
    with RankTelemetry(path) as tx:
        tx.send_checkpoint(sample)
        tx.send_checkpoint(sample.model_copy(update={"valid": False, "loss": math.nan, "message": "corrupt"}))
    first, second = (SAMPLES.validate_python(json.loads(rx.recv(1 << 17)))[0] for _ in range(2))
    assert first == sample
    assert isinstance(second, CheckpointSample) and not second.valid and second.loss is None
    assert second.message == "corrupt"


def test_non_finite_loss_is_sent_as_null(sock_dir: Path) -> None:
    path = sock_dir / "a.sock"
    rx = _listener(path)
    with RankTelemetry(path) as tx:
        tx.send_step(_step(1, loss=math.nan))
        tx.send_step(_step(2, loss=math.inf))
    got = [json.loads(rx.recv(1 << 17))[0] for _ in range(2)]
    assert [g["loss"] for g in got] == [None, None]
    assert all(StepSample.model_validate(g).loss is None for g in got)


def test_no_agent_never_raises_and_drops_arrive_with_next_sample(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"  # nobody there yet: ENOENT
    tx = RankTelemetry(path)
    t0 = time.perf_counter()
    for s in range(1, 4):
        tx.send_step(_step(s), [_record(s, 0)])  # 2 samples per step
    assert time.perf_counter() - t0 < 0.5
    assert tx.dropped == 6 and tx.sent_total == 0

    # A socket file with no one reading it: ECONNREFUSED, also dropped quietly.
    dead = _listener(path)
    dead.close()
    assert path.exists()
    tx.send_step(_step(4))
    assert tx.dropped == 7
    path.unlink()

    rx = _listener(path)  # the agent comes (back)
    tx.send_step(_step(5), [_record(5, 0)])
    first = json.loads(rx.recv(1 << 17))
    assert first[0]["step"] == 5 and first[0]["dropped"] == 7
    assert tx.dropped == 0 and tx.dropped_total == 7
    tx.send_step(_step(6))
    assert json.loads(rx.recv(1 << 17))[0]["dropped"] == 0  # counted once, then reset
    tx.close()


def test_full_agent_queue_never_blocks_and_is_counted(sock_dir: Path) -> None:
    path = sock_dir / "slow.sock"
    rx = _listener(path)  # bound but not reading: the kernel queue fills (EAGAIN)
    tx = RankTelemetry(path)
    t0 = time.perf_counter()
    sends = 200
    for s in range(1, sends + 1):
        tx.send_step(_step(s))
    assert time.perf_counter() - t0 < 2.0
    assert tx.dropped > 0, "the queue never filled: the test did not exercise EAGAIN"
    assert tx.sent_total + tx.dropped == sends
    queued = _recv_all(rx)
    assert sum(len(d) for d in queued) == tx.sent_total
    dropped = tx.dropped
    tx.send_step(_step(sends + 1))
    assert json.loads(rx.recv(1 << 17))[0]["dropped"] == dropped
    tx.close()


def test_large_lists_are_split_into_datagrams_under_the_limit(sock_dir: Path) -> None:
    path = sock_dir / "big.sock"
    rx = _listener(path)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    records = [_record(9, i, tag=f"bucket-{i}") for i in range(1500)]
    with RankTelemetry(path) as tx:
        tx.send_step(_step(9), records)
        assert tx.dropped == 0
    datagrams = []
    rx.setblocking(False)
    try:
        while True:
            datagrams.append(rx.recv(1 << 17))
    except BlockingIOError:
        pass
    assert len(datagrams) > 1
    assert all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)
    items = [i for d in datagrams for i in SAMPLES.validate_json(d)]
    assert len(items) == 1501
    assert isinstance(items[0], StepSample)
    assert [i.seq for i in items[1:] if isinstance(i, CollectiveSample)] == list(range(1500))


def test_pack_respects_limit_and_order() -> None:
    encoded = [encode({"kind": "x", "i": i, "pad": "p" * (i % 50)}) for i in range(300)]
    encoded.insert(7, b"y" * 2000)  # one item alone over the limit
    datagrams, oversize = pack(encoded, limit=1000)
    assert oversize == [7]
    assert all(len(d) <= 1000 for d, _ in datagrams)
    flat = [j for _, idx in datagrams for j in idx]
    assert flat == [j for j in range(301) if j != 7]
    assert [x["i"] for d, _ in datagrams for x in json.loads(d)] == list(range(300))
