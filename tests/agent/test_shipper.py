"""Shipper state machine: batch limits, numbering, outage spooling and ordered replay, 422 drop,
backoff, full spool accounting. Driven step by step with a fake clock and a fake transport.

Needs: a writable temporary folder. No network (the real HTTP path is in test_integration.py).
"""

from __future__ import annotations

import random

import httpx
import pytest

from agent.receiver import SampleBuffer
from agent.shipper import Shipper, ShipperConfig
from agent.spool import Spool
from tests.agent.doubles import FakeClock, FakeTransport, step_dict
from vigil.contract.client import ApiError
from vigil.contract.schemas import MAX_TELEMETRY_ITEMS, Heartbeat, StepSample

DOWN = httpx.ConnectError("[Errno 111] Connection refused")


def samples(start: int, n: int) -> list[StepSample]:
    return [StepSample.model_validate(step_dict(i)) for i in range(start, start + n)]


class Rig:
    """A shipper with its buffer, spool, fake transport and fake clock."""

    def __init__(self, spool_dir, heartbeat: bool = True, spool_max_bytes: int = 64 << 20, **cfg) -> None:
        self.clock = FakeClock()
        self.transport = FakeTransport()
        self.buffer = SampleBuffer(capacity=1_000_000)
        self.spool = Spool(spool_dir, max_bytes=spool_max_bytes)
        cfg.setdefault("backoff_jitter", 0.0)
        self.config = ShipperConfig(agent_id="host-n1", node_id="n1", **cfg)
        self.shipper = Shipper(
            self.config,
            self.buffer,
            self.spool,
            self.transport,
            heartbeat=(lambda ts, dropped: Heartbeat(ts=ts, hostname="h", dropped_samples=dropped))
            if heartbeat
            else None,
            clock=self.clock,
            wall_clock=self.clock,
            rng=random.Random(0),
        )

    def put(self, start: int, n: int) -> None:
        self.buffer.put_many(samples(start, n))

    def steps(self) -> list[int]:
        return [s.step for s in self.transport.stored_samples]


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path / "spool", heartbeat=False)
    yield r
    r.spool.close()


def test_batches_are_bounded_by_item_count(rig):
    rig.put(0, 4500)
    rig.shipper.step()
    assert [len(b.samples) for b in rig.transport.stored] == [2000, 2000]  # 500 wait for the timer
    assert len(rig.buffer) == 500
    rig.clock.advance(0.5)
    rig.shipper.step()
    assert [len(b.samples) for b in rig.transport.stored] == [2000, 2000, 500]
    assert rig.steps() == list(range(4500))
    assert rig.transport.stored_seqs == [0, 1, 2]
    assert all(b.agent_id == "host-n1" and b.node_id == "n1" for b in rig.transport.stored)


def test_batches_are_bounded_in_time(rig):
    rig.put(0, 10)
    rig.shipper.step()
    rig.clock.advance(0.49)
    rig.shipper.step()
    assert rig.transport.calls == []  # younger than the flush interval: still waiting
    rig.clock.advance(0.01)
    wait = rig.shipper.step()
    assert rig.steps() == list(range(10))
    assert wait == pytest.approx(0.5)  # next flush


def test_max_batch_items_cannot_exceed_the_api_limit():
    with pytest.raises(ValueError, match="max_batch_items"):
        ShipperConfig(agent_id="a", node_id="n", max_batch_items=MAX_TELEMETRY_ITEMS + 1)
    ShipperConfig(agent_id="a", node_id="n", max_batch_items=MAX_TELEMETRY_ITEMS)


def test_oversized_batch_is_split_keeping_order(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=False, max_batch_bytes=20_000)  # ~250 bytes per sample
    rig.put(0, 300)
    rig.clock.advance(0.5)
    rig.shipper.step()
    rig.clock.advance(0.5)
    rig.shipper.step()
    sizes = [len(b.samples) for b in rig.transport.stored]
    assert sum(sizes) == 300 and max(sizes) < 300 and len(sizes) >= 4
    assert rig.steps() == list(range(300))
    assert rig.transport.stored_seqs == sorted(rig.transport.stored_seqs)


def test_numbering_continues_after_a_restart(tmp_path):
    first = Rig(tmp_path / "s", heartbeat=False)
    first.put(0, 5)
    first.shipper.flush()
    first.put(5, 5)
    first.shipper.flush()
    assert first.transport.stored_seqs == [0, 1]
    first.spool.close()
    second = Rig(tmp_path / "s", heartbeat=False)
    second.put(10, 5)
    second.shipper.flush()
    assert second.transport.stored_seqs == [2]
    second.spool.close()


def test_outage_spools_and_replays_in_order_exactly_once(rig):
    rig.put(0, 100)
    rig.clock.advance(0.5)
    rig.shipper.step()
    assert rig.transport.stored_seqs == [0]
    rig.transport.fail_with = DOWN
    for i in range(5):  # 5 batches cut during the outage
        rig.put(100 + 10 * i, 10)
        rig.clock.advance(0.5)
        rig.shipper.step()
    assert [b.seq for b in rig.spool.batches()] == [1, 2, 3, 4, 5]
    rig.transport.fail_with = None
    rig.put(150, 10)  # arrives while the shipper still backs off: must queue behind the spool
    rig.clock.advance(0.5)
    rig.shipper.step()
    rig.clock.advance(20)
    rig.shipper.step()
    assert len(rig.spool) == 0
    assert rig.transport.stored_seqs == [0, 1, 2, 3, 4, 5, 6]
    assert rig.steps() == list(range(160))
    assert rig.shipper.stats.duplicate_batches == 0


def test_5xx_is_retried_not_dropped(rig):
    rig.transport.fail_with = ApiError(503, "database locked")
    rig.put(0, 10)
    rig.clock.advance(0.5)
    rig.shipper.step()
    assert len(rig.spool) == 1 and rig.shipper.stats.rejected_batches == 0
    rig.transport.fail_with = None
    rig.clock.advance(1)
    rig.shipper.step()
    assert rig.steps() == list(range(10)) and len(rig.spool) == 0


def test_422_is_dropped_without_retry_and_reported_as_loss(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=True)
    rig.shipper.step()  # first heartbeat, nothing lost yet
    assert rig.transport.stored[0].heartbeat.dropped_samples == 0
    rig.transport.fail_with = ApiError(422, [{"loc": ["body", "samples", 0], "msg": "bad"}])
    rig.put(0, 7)
    rig.clock.advance(0.5)
    rig.shipper.step()
    calls_after_reject = len(rig.transport.calls)
    assert rig.shipper.stats.rejected_batches == 1 and rig.shipper.stats.rejected_samples == 7
    assert len(rig.spool) == 0 and not rig.shipper.backing_off
    rig.transport.fail_with = None
    for _ in range(4):
        rig.clock.advance(0.5)
        rig.shipper.step()
    rejected_seq = rig.transport.calls[calls_after_reject - 1].seq
    assert [b.seq for b in rig.transport.calls].count(rejected_seq) == 1  # never posted again
    hbs = [b.heartbeat for b in rig.transport.stored if b.heartbeat is not None]
    assert hbs[-1].dropped_samples == 7
    rig.spool.close()


def test_backoff_doubles_up_to_the_cap_and_resets_on_success(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=False, backoff_initial_s=0.2, backoff_max_s=1.0)
    rig.transport.fail_with = DOWN
    rig.put(0, 1)
    rig.clock.advance(0.5)
    rig.shipper.step()
    delays = [rig.shipper.retry_delay_s]
    for _ in range(5):
        rig.clock.advance(rig.shipper.retry_delay_s - 0.001)
        n = len(rig.transport.calls)
        rig.shipper.step()
        assert len(rig.transport.calls) == n  # not retried before the backoff ran out
        rig.clock.advance(0.001)
        rig.shipper.step()
        assert len(rig.transport.calls) == n + 1
        delays.append(rig.shipper.retry_delay_s)
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    rig.transport.fail_with = None
    rig.clock.advance(1.0)
    rig.shipper.step()
    assert rig.shipper.retry_delay_s == 0.0 and len(rig.spool) == 0
    rig.transport.fail_with = DOWN  # a new outage starts again from the first delay
    rig.put(1, 1)
    rig.clock.advance(0.5)
    rig.shipper.step()
    assert rig.shipper.retry_delay_s == pytest.approx(0.2)
    rig.spool.close()


def test_backoff_jitter_shortens_waits_within_bounds(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=False, backoff_initial_s=1.0, backoff_max_s=1.0, backoff_jitter=0.5)
    rig.transport.fail_with = DOWN
    seen = []
    rig.put(0, 1)
    rig.clock.advance(0.5)
    for _ in range(20):
        rig.shipper.step()
        seen.append(rig.shipper.retry_delay_s)
        rig.clock.advance(rig.shipper.retry_delay_s)
    assert all(0.5 <= d <= 1.0 for d in seen) and len(set(seen)) > 1
    rig.spool.close()


def test_full_spool_drops_oldest_and_next_heartbeat_reports_the_loss(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=True, heartbeat_interval_s=100.0, spool_max_bytes=6000)
    rig.shipper.step()  # the first heartbeat goes out while the controller is up
    rig.transport.fail_with = DOWN
    for i in range(30):  # 30 batches of 20 samples, ~1 KB each compressed: the spool holds a few
        rig.put(20 * i, 20)
        rig.clock.advance(0.5)
        rig.shipper.step()
    spooled = rig.spool.batches()
    lost = rig.spool.dropped_samples
    assert 0 < len(spooled) < 30 and lost == 20 * (30 - len(spooled))
    assert rig.spool.size_bytes <= 6000
    rig.transport.fail_with = None
    rig.clock.advance(100)
    rig.shipper.step()
    # What survived is the newest data, in order; the heartbeat after the loss counts it exactly.
    first_kept = 20 * (30 - len(spooled))
    assert rig.steps() == list(range(first_kept, 600))
    hb = [b.heartbeat for b in rig.transport.stored if b.heartbeat is not None][-1]
    assert hb.dropped_samples == lost
    assert rig.shipper.dropped_samples == lost
    rig.spool.close()


def test_heartbeat_every_interval_even_without_samples(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=True, heartbeat_interval_s=1.0)
    for _ in range(9):  # t = 0, 0.5, ..., 4.0
        rig.shipper.step()
        rig.clock.advance(0.5)
    hbs = [b for b in rig.transport.stored if b.heartbeat is not None]
    assert [b.heartbeat.ts - 1000.0 for b in hbs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(b.samples == [] for b in hbs)
    rig.spool.close()


def test_final_flush_sends_what_it_can_and_leaves_the_rest_spooled(tmp_path):
    rig = Rig(tmp_path / "s", heartbeat=True, heartbeat_interval_s=100.0)
    rig.shipper.step()
    rig.put(0, 2500)
    rig.shipper.flush()
    assert rig.steps() == list(range(2500)) and len(rig.buffer) == 0
    rig.transport.fail_with = DOWN
    rig.put(2500, 30)
    rig.shipper.flush()
    assert len(rig.spool) == 1 and rig.spool.samples == 30
    last = rig.spool.oldest()
    assert last.seq > rig.transport.stored_seqs[-1]
    rig.spool.close()
