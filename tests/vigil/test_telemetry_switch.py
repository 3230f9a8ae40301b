"""``VIGIL_TELEMETRY=off`` makes rank telemetry a no-op; on (the default) it sends. Needs: AF_UNIX."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from vigil.comm import CollectiveRecord
from vigil.contract.schemas import StepSample
from vigil.telemetry import RankTelemetry


def _step() -> StepSample:
    return StepSample(job_id="job_sw", rank=0, step=1, ts=time.time(), loss=1.0, step_time_s=0.1)


@pytest.mark.parametrize(("value", "sent"), [(None, 2), ("on", 2), ("off", 0), ("OFF", 0), ("0", 0)])
def test_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str | None, sent: int) -> None:
    if value is None:
        monkeypatch.delenv("VIGIL_TELEMETRY", raising=False)
    else:
        monkeypatch.setenv("VIGIL_TELEMETRY", value)
    path = tmp_path / "a.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(str(path))
        srv.setblocking(False)
        with RankTelemetry(path) as t:
            rec = CollectiveRecord(1, 0, "all_reduce", "world", "grads", 8, 8, 2, 0.001, time.time())
            t.send_step(_step(), [rec])
            assert (t.sent_total, t.dropped_total) == (sent, 0)
        got = []
        try:
            while True:
                got.append(srv.recv(65536))
        except BlockingIOError:
            pass
        assert len(got) == (1 if sent else 0)
