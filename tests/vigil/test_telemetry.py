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
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from vigil.comm import CollectiveRecord
from vigil.contract.schemas import CheckpointSample, CollectiveSample, FaultSample, RankSample, StepSample
from vigil.telemetry import MAX_DATAGRAM_BYTES, RankTelemetry, encode, pack

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


def _read_until(s: socket.socket, last_step: int) -> list[int]:
    """Step numbers read from ``s`` (blocking, 2 s timeout a datagram) until ``last_step`` arrives."""
    steps: list[int] = []
    while not steps or steps[-1] != last_step:
        steps += _steps([json.loads(s.recv(1 << 17))])
    return steps


def _step(step: int, loss: float | None = 1.0, ts: float | None = None) -> StepSample:
    ts = time.time() if ts is None else ts
    return StepSample(job_id="job", rank=1, world_size=2, step=step, ts=ts, loss=loss, step_time_s=0.1)


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
        # Built as the rank builds one (validated): its NaN loss is None from then on, and goes out as null.
        tx.send_checkpoint(CheckpointSample(**{**sample.model_dump(), "valid": False, "loss": math.nan,
                                               "message": "corrupt"}))
    first, second = (SAMPLES.validate_python(json.loads(rx.recv(1 << 17)))[0] for _ in range(2))
    assert first == sample
    assert isinstance(second, CheckpointSample) and not second.valid and second.loss is None
    assert second.message == "corrupt"


def test_a_fault_report_goes_out_as_the_wire_schema_even_with_telemetry_off(
        sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = sock_dir / "a.sock"
    rx = _listener(path)
    monkeypatch.setenv("VIGIL_TELEMETRY", "off")
    sample = FaultSample(job_id="job", rank=1, step=35, attempt=2, ts=time.time(), fault_id=7, fault_kind="kill_rank")
    with RankTelemetry(path) as tx:
        tx.send_step(_step(1))  # off: nothing
        tx.send_fault(sample)
    assert SAMPLES.validate_json(rx.recv(1 << 17)) == [sample]  # what the agent decodes


def test_non_finite_loss_is_sent_as_null(sock_dir: Path) -> None:
    path = sock_dir / "a.sock"
    rx = _listener(path)
    with RankTelemetry(path) as tx:
        tx.send_step(_step(1, loss=math.nan))
        tx.send_step(_step(2, loss=math.inf))
    got = [json.loads(rx.recv(1 << 17))[0] for _ in range(2)]
    assert [g["loss"] for g in got] == [None, None]
    assert all(StepSample.model_validate(g).loss is None for g in got)


def test_non_finite_values_become_none_once_when_the_sample_is_built(sock_dir: Path) -> None:
    """The schema turns a non-finite loss, lr, val_loss into None as the sample is built; send adds nothing:
    a dict that still holds NaN is not sent (JSON without NaN) but dropped and counted."""
    sample = StepSample(job_id="job", rank=1, step=3, ts=time.time(), loss=math.inf, lr=math.nan,
                        val_loss=-math.inf, step_time_s=0.1)
    assert (sample.loss, sample.lr, sample.val_loss) == (None, None, None)
    path = sock_dir / "a.sock"
    rx = _listener(path)
    with RankTelemetry(path) as tx:
        assert tx.send([{**sample.model_dump(mode="json"), "loss": math.nan}]) == 0
        assert tx.dropped == 1
        tx.send_step(sample)
    (got,) = json.loads(rx.recv(1 << 17))
    assert (got["loss"], got["lr"], got["val_loss"], got["dropped"]) == (None, None, None, 1)


def _steps(datagrams: list[list[dict]]) -> list[int]:
    return [i["step"] for d in datagrams for i in d if i["kind"] == "step"]


def test_no_agent_never_raises_and_nothing_is_lost_when_it_comes(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"  # nobody there yet: ENOENT
    tx = RankTelemetry(path)
    t0 = time.perf_counter()
    for s in range(1, 4):
        tx.send_step(_step(s), [_record(s, 0)])  # 2 samples per step
    assert time.perf_counter() - t0 < 0.5
    assert tx.sent_total == 0 and tx.dropped_total == 0  # waiting in the backlog

    # A socket file with no one reading it: ECONNREFUSED, also kept quietly.
    dead = _listener(path)
    dead.close()
    assert path.exists()
    tx.send_step(_step(4))
    path.unlink()

    rx = _listener(path)  # the agent comes (back): the backlog first, in order, then the new step
    tx.send_step(_step(5), [_record(5, 0)])
    assert _steps(_recv_all(rx)) == [1, 2, 3, 4, 5]
    assert tx.sent_total == 9 and tx.dropped_total == 0
    tx.close()


def test_full_agent_queue_never_blocks_and_the_rest_follows(sock_dir: Path) -> None:
    path = sock_dir / "slow.sock"
    rx = _listener(path)  # bound but not reading: the kernel queue fills (EAGAIN)
    tx = RankTelemetry(path)
    t0 = time.perf_counter()
    sends = 200
    for s in range(1, sends + 1):
        tx.send_step(_step(s))
    assert time.perf_counter() - t0 < 2.0
    assert tx.sent_total < sends, "the queue never filled: the test did not exercise EAGAIN"
    got = _steps(_recv_all(rx))
    while len(got) <= sends:  # the agent reads; each later send delivers what waited
        tx.send_step(_step(len(got) + 1)) if len(got) == sends else tx.flush()
        got += _steps(_recv_all(rx))
    assert got == list(range(1, sends + 2)) and tx.dropped_total == 0
    tx.close()


def test_close_waits_for_a_busy_agent_to_take_the_last_steps(sock_dir: Path) -> None:
    path = sock_dir / "busy.sock"
    rx = _listener(path)  # bound but not reading yet: the last steps wait in the backlog
    tx = RankTelemetry(path)
    sends = 200
    for s in range(1, sends + 1):
        tx.send_step(_step(s))
    assert tx.sent_total < sends, "the queue never filled: the test did not exercise EAGAIN"
    got: list[int] = []
    reader = threading.Thread(target=lambda: [time.sleep(0.3), got.extend(_read_until(rx, sends))])
    reader.start()
    tx.close()  # the rank ends: close drains what the agent had no room for
    reader.join(5)
    assert got == list(range(1, sends + 1)) and tx.dropped_total == 0


def test_offer_delivers_what_waited_without_a_next_send_and_gives_up_in_time(sock_dir: Path) -> None:
    """The watcher's offer (a stalled rank sends nothing more): a burst the agent's queue could not take
    goes once the agent reads; an agent that never reads costs a bounded wait and loses nothing."""
    path = sock_dir / "stalled.sock"
    rx = _listener(path)  # bound but not reading yet: the burst fills the queue
    tx = RankTelemetry(path)
    sends = 60
    for s in range(1, sends + 1):
        tx.send_step(_step(s))
    assert tx.unsent, "the queue never filled: the test did not exercise EAGAIN"
    t0 = time.perf_counter()
    assert tx.offer(0.2) > 0 and 0.2 <= time.perf_counter() - t0 < 1.0  # nobody reads: given up, kept
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(_read_until(rx, sends)))
    reader.start()
    assert tx.offer(5.0) == 0  # no send after the burst: the offer alone delivers it as the agent reads
    reader.join(5)
    assert got == list(range(1, sends + 1)) and tx.dropped_total == 0
    tx.close()


def test_close_does_not_wait_without_an_agent(sock_dir: Path) -> None:
    path = sock_dir / "gone.sock"
    tx = RankTelemetry(path)
    tx.send_step(_step(1))  # ENOENT: kept in the backlog
    stale = _listener(path)
    stale.close()  # a dead agent's socket file: ECONNREFUSED
    t0 = time.perf_counter()
    assert tx.drain() == 1
    tx.close()
    path.unlink()
    tx2 = RankTelemetry(path)
    tx2.send_step(_step(1))
    tx2.close()
    assert time.perf_counter() - t0 < 1.0


def test_a_full_backlog_drops_the_oldest_and_says_so_in_the_next_step(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"
    # A fixed ts: time.time()'s repr varies in length (CI once fitted only four of "five" datagrams).
    ts = 1_700_000_000.25
    one = len(encode(_step(1, ts=ts).model_dump(mode="json"))) + 2
    tx = RankTelemetry(path, backlog_bytes=5 * one + one // 2)  # room for five steps' datagrams, not six
    for s in range(1, 9):
        tx.send_step(_step(s, ts=ts))
    assert tx.dropped_total == 3  # steps 1-3
    rx = _listener(path)
    tx.send_step(_step(9, ts=ts))
    got = [i for d in _recv_all(rx) for i in d]
    assert [i["step"] for i in got] == [5, 6, 7, 8, 9]  # the oldest went first (step 4 for step 9)
    # Each loss counted once: in the next step queued after it (the count of step 4's, still pending).
    assert tx.dropped_total == 4 and sum(i["dropped"] for i in got) + tx.dropped == 4
    assert [i["dropped"] for i in got] == [0, 0, 1, 1, 1]
    tx.close()


def test_a_restarted_agent_gets_the_replay_window_again(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"
    rx = _listener(path)
    tx = RankTelemetry(path)
    for s in range(1, 4):
        tx.send_step(_step(s))
    assert _steps(_recv_all(rx)) == [1, 2, 3]
    tx.send_step(_step(4))  # the same agent: only the new step
    assert _steps(_recv_all(rx)) == [4]
    # kill -9 of the agent (what it held in memory is gone) and a new one on the same path.
    rx.close()
    path.unlink()
    rx = _listener(path)
    tx.send_step(_step(5))
    assert _steps(_recv_all(rx)) == [1, 2, 3, 4, 5] and tx.replays == 1
    tx.send_step(_step(6))
    assert _steps(_recv_all(rx)) == [6]
    tx.close()
    # Outside the window nothing is sent again.
    quick = RankTelemetry(path, replay_window_s=0.0)
    quick.send_step(_step(7))
    _recv_all(rx)
    rx.close()
    path.unlink()
    rx = _listener(path)
    quick.send_step(_step(8))
    assert _steps(_recv_all(rx)) == [8]
    quick.close()


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


def _close_with_a_successor(tx: RankTelemetry, path: Path, last_step: int) -> list[int]:
    """Close ``tx`` while a new agent takes the dead one's path 0.8 s later (as ``vigil up``'s keeper starts
    it again); the steps that agent got, up to ``last_step``."""
    got: list[int] = []

    def successor() -> None:
        time.sleep(0.8)
        path.unlink()
        again = _listener(path)
        got.extend(_read_until(again, last_step))
        again.close()

    t = threading.Thread(target=successor)
    t.start()
    tx.close()
    t.join(10)
    return got


def test_close_waits_for_a_dead_agents_successor_and_gives_it_everything(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"
    rx = _listener(path)
    tx = RankTelemetry(path)
    tx.send_step(_step(1))
    assert _steps(_recv_all(rx)) == [1]
    rx.close()  # kill -9 of the agent: its socket file stays, nobody reads it
    for s in range(2, 5):
        tx.send_step(_step(s))  # the rank trains on: kept in its backlog
    got = _close_with_a_successor(tx, path, 4)  # the rank ends before the agent is back: close waits for it
    assert got == [1, 2, 3, 4] and tx.dropped_total == 0  # step 1 again: the dead agent may have lost it


def test_close_replays_to_the_successor_of_an_agent_that_died_after_taking_everything(sock_dir: Path) -> None:
    """Every step was delivered, then the agent was killed before it passed them on: the rank that ends
    then waits for the next agent and sends its replay window again."""
    path = sock_dir / "agent.sock"
    rx = _listener(path)
    tx = RankTelemetry(path)
    for s in range(1, 4):
        tx.send_step(_step(s))
    assert _steps(_recv_all(rx)) == [1, 2, 3] and tx.unsent == 0
    rx.close()  # kill -9: the socket file stays, nobody reads it
    assert _close_with_a_successor(tx, path, 3) == [1, 2, 3] and tx.replays == 1


def test_close_does_not_wait_for_a_live_agent_that_took_everything(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"
    rx = _listener(path)
    tx = RankTelemetry(path)
    tx.send_step(_step(1))
    t0 = time.perf_counter()
    tx.close()
    assert time.perf_counter() - t0 < 5.0 and _steps(_recv_all(rx)) == [1] and tx.replays == 0
    rx.close()


def test_close_waits_a_bounded_time_for_an_agent_that_never_comes_back(sock_dir: Path) -> None:
    path = sock_dir / "agent.sock"
    rx = _listener(path)
    tx = RankTelemetry(path)
    tx.send_step(_step(1))
    rx.close()
    path.unlink()
    tx.send_step(_step(2))
    t0 = time.perf_counter()
    assert tx.drain(return_s=0.5) == 1  # step 2 is still undelivered, after about return_s
    assert 0.4 < time.perf_counter() - t0 < 10.0  # it waited, and gave up
