"""The agent's columnar encoder (:mod:`agent.columnar`) and the shipper's use of it: a batch survives
encode -> decode unchanged (on the agent's own decoder and on the controller's), the shipper posts
columns when its transport can, falls back to JSON (same batch number, same samples) when the
controller answers 404, and spooled batches keep and replay in their format.
Driven with fakes: no server, no database.
"""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
from pydantic import TypeAdapter

from agent import columnar
from agent.receiver import SampleBuffer
from agent.shipper import Shipper, ShipperConfig
from agent.spool import Spool
from controller.columnar import decode, rows
from controller.telemetry import COLLECTIVE_COLUMNS, STEP_COLUMNS
from tests.agent.doubles import FakeClock, FakeTransport, collective_dict, step_dict
from vigil.contract.client import ApiError
from vigil.contract.schemas import Heartbeat, RankSample, TelemetryAck, TelemetryBatch

_SAMPLES = TypeAdapter(list[RankSample])


def _samples() -> list:
    items = []
    for step in range(3):
        for rank in range(2):
            s = step_dict(step, rank=rank, pid=100 + rank)
            if rank == 1:
                s |= {"loss": None, "data_s": 0.01, "lr": 1e-3}
            items += [s, collective_dict(step, 0, rank=rank), {**collective_dict(step, 1, rank=rank), "tag": "grads"}]
    items.append({"kind": "checkpoint", "job_id": "job-1", "step": 2, "ts": 1.0, "path": "/c/2"})
    return _SAMPLES.validate_python(items)


def test_a_batch_survives_encoding_on_both_decoders() -> None:
    samples = _samples()
    hb = Heartbeat(ts=5.0, hostname="h", host={"cpu": 1.0})
    body = columnar.encode("a", "n", 7, 3.0, samples, hb)
    batch = columnar.to_batch(body)
    assert (batch.agent_id, batch.node_id, batch.seq, batch.sent_at, batch.heartbeat) == ("a", "n", 7, 3.0, hb)
    key = lambda s: (s.kind, s.step, s.rank, getattr(s, "seq", -1))
    assert sorted(batch.samples, key=key) == sorted(samples, key=key)
    dec = decode(body)  # the controller's decoder: the rows it would store
    steps = [s for s in samples if s.kind == "step"]
    colls = [s for s in samples if s.kind == "collective"]
    assert rows("step", dec.step, STEP_COLUMNS, dec.strings, "n") == [
        (*(getattr(s, c) for c in STEP_COLUMNS), "n") for s in steps]
    assert rows("collective", dec.collective, COLLECTIVE_COLUMNS, dec.strings, "n") == [
        (*(getattr(s, c) for c in COLLECTIVE_COLUMNS), "n") for s in colls]
    assert [s.kind for s in dec.header.samples] == ["checkpoint"]


def test_a_non_finite_loss_travels_as_none() -> None:
    s = _SAMPLES.validate_python([{**step_dict(1), "loss": math.nan}])
    out = columnar.to_batch(columnar.encode("a", "n", 0, 0.0, s)).samples[0]
    assert out.loss is None


def test_nan_in_a_column_is_none_after_the_json_fallback_decodes_it() -> None:
    """A column may carry NaN for None (the bench's columns do): the fallback's samples hold None, by the
    schema's one rule, and re-encode as JSON null."""
    s = _SAMPLES.validate_python([step_dict(1), step_dict(2)])
    table = columnar.StringTable()
    blk = columnar.block("step", s, table)
    for name in ("loss", "lr", "val_loss"):
        blk.columns[name] = np.array([math.nan, math.inf], "<f8").tobytes()
    header = TelemetryBatch(agent_id="a", node_id="n", seq=0, sent_at=0.0).model_dump_json().encode()
    out = columnar.to_batch(columnar.encode_blocks(header, table.strings, blk, None))
    assert [(x.loss, x.lr, x.val_loss) for x in out.samples] == [(None, None, None)] * 2
    assert '"loss":null' in out.model_dump_json()


class ColumnarFake(FakeTransport):
    """A fake controller that takes columns too, or answers 404 to them (an older controller)."""

    def __init__(self, has_columnar: bool = True) -> None:
        super().__init__()
        self.has_columnar = has_columnar
        self.columnar_posts = 0

    def post_columnar(self, body: bytes) -> TelemetryAck:
        if not self.has_columnar:
            raise ApiError(404, "Not Found")
        self.columnar_posts += 1
        return self.post(gzip.compress(columnar.to_batch(gzip.decompress(body)).model_dump_json().encode()))


def _shipper(tmp_path, transport, **cfg):  # type: ignore[no-untyped-def]
    clock = FakeClock()
    buf = SampleBuffer()
    spool = Spool(tmp_path / "spool")
    sh = Shipper(ShipperConfig(agent_id="a", node_id="n", **cfg), buf, spool, transport, clock=clock,
                 wall_clock=lambda: 1.7e9)
    return sh, buf, spool, clock


@pytest.mark.parametrize("has_columnar", [True, False])
def test_the_shipper_posts_columns_or_falls_back_to_json_on_404(tmp_path, has_columnar: bool) -> None:
    t = ColumnarFake(has_columnar)
    sh, buf, spool, _ = _shipper(tmp_path, t, max_batch_items=5)
    buf.put_many(_samples())
    sh.flush()
    assert len(spool) == 0
    assert t.stored_seqs == list(range(len(t.stored_seqs)))
    assert len(t.stored_samples) == len(_samples())
    assert (t.columnar_posts > 0) == has_columnar
    assert (sh.stats.json_fallbacks > 0) == (not has_columnar)
    spool.close()


def test_spooled_columnar_batches_keep_their_format_and_replay_once(tmp_path) -> None:
    t = ColumnarFake()
    t.fail_with = ConnectionError("down")
    sh, buf, spool, clock = _shipper(tmp_path, t, max_batch_items=4, heartbeat_interval_s=0)
    buf.put_many(_samples())
    sh.flush()
    assert {b.format for b in spool.batches()} == {"columnar"}
    assert all(b.path.name.endswith(".cols.gz") for b in spool.batches())
    spool.close()
    # A new run finds them on disk, in their format, and replays them in order.
    t.fail_with = None
    spool = Spool(tmp_path / "spool")
    assert {b.format for b in spool.batches()} == {"columnar"}
    sh2 = Shipper(ShipperConfig(agent_id="a", node_id="n", heartbeat_interval_s=0), SampleBuffer(), spool, t,
                  clock=clock)
    sh2.step()
    assert len(spool) == 0 and len(t.stored_samples) == len(_samples())
    assert t.stored_seqs == sorted(t.stored_seqs)
    spool.close()


def test_json_transports_and_json_config_get_json(tmp_path) -> None:
    for transport, cfg in ((FakeTransport(), {}), (ColumnarFake(), {"wire_format": "json"})):
        sh, buf, spool, _ = _shipper(tmp_path / str(id(transport)), transport, **cfg)
        buf.put_many(_samples()[:3])
        sh.flush()
        assert len(transport.stored_samples) == 3
        assert getattr(transport, "columnar_posts", 0) == 0
        spool.close()
    with pytest.raises(ValueError, match="wire_format"):
        ShipperConfig(agent_id="a", node_id="n", wire_format="xml")
