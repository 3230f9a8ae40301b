"""A replacement replica whose first heal fails asks again and heals from its live peer.

Real torchft (a lighthouse, two managers, gloo, the HTTP heal) in one process, two threads; the
replacement's first checkpoint transfer fails (as a transfer that timed out on a loaded machine does).
Seen in CI: the replacement then took the disk checkpoint, ran old steps again beside a survivor far
ahead, and had to restart a second time. It must ask for a quorum again and heal from the peer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from vigil.live import LiveReplica, start_lighthouse

JOIN_TIMEOUT_MS = 300
COLLECTIVE_TIMEOUT_S = 2.0
"""The survivor's all-reduce in the quorum whose heal failed waits this long for the replacement (which
asks for a new quorum instead); the next quorum must rebuild the process group that timed out."""


def _replica(rank: int, lighthouse: str, *, replacement: bool, value: float) -> tuple[LiveReplica, torch.nn.Linear]:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    live = LiveReplica(rank=rank, world_size=2, min_replicas=1, lighthouse=lighthouse, host="127.0.0.1",
                       replica_id=f"test_{rank}", replacement=replacement, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    live.register({"model": model})
    return live, model


def _step(live: LiveReplica, model: torch.nn.Linear, number: int) -> None:
    live.start_step(number)
    for p in model.parameters():
        grad = torch.full_like(p, float(number))
        live.comm.all_reduce(grad, torch.distributed.ReduceOp.AVG)
        with torch.no_grad():
            p.add_(grad, alpha=-0.01)
    live.end_step()


def test_a_replacement_whose_heal_fails_asks_again_and_heals_from_the_peer() -> None:
    torch.set_num_threads(1)
    server = start_lighthouse(1, bind="127.0.0.1:0", join_timeout_ms=JOIN_TIMEOUT_MS)
    address = server.address()
    survivor, s_model = _replica(0, address, replacement=False, value=1.0)
    out: dict[str, Any] = {"disk_restores": 0}
    try:
        assert survivor.restore(lambda: 0) == 0
        for n in range(1, 4):
            _step(survivor, s_model, n)
        started = threading.Event()

        def replace() -> None:
            def disk() -> int:
                out["disk_restores"] += 1
                return 0

            live, model = _replica(1, address, replacement=True, value=-5.0)
            out["live"], out["model"] = live, model
            transport = live.manager._checkpoint_transport
            recv = transport.recv_checkpoint

            def flaky(*a: Any, **kw: Any) -> Any:
                if out.setdefault("transfers", 0) == 0:
                    out["transfers"] += 1
                    raise TimeoutError("checkpoint transfer timed out")
                out["transfers"] += 1
                return recv(*a, **kw)

            transport.recv_checkpoint = flaky
            started.set()
            try:
                out["restored"] = live.restore(disk)
                _step(live, model, out["restored"] + 1)
            except BaseException as e:  # noqa: BLE001 - reported by the assertions below
                out["error"] = e

        t = threading.Thread(target=replace, daemon=True)
        t.start()
        assert started.wait(30)
        # The survivor trains on; the replacement's quorums join its steps.
        n = 4
        deadline = time.monotonic() + 60
        while t.is_alive() and time.monotonic() < deadline:
            _step(survivor, s_model, n)
            n += 1
            time.sleep(0.05)
        t.join(60)
        assert not t.is_alive(), "the replacement did not finish its first step"
        assert "error" not in out, repr(out.get("error"))
        assert out["disk_restores"] == 0, "the replacement took the disk checkpoint while its peer trained"
        assert out["transfers"] == 2  # the failed one, then the heal
        assert out["restored"] >= 3 and len(out["live"].heals) == 1
        assert out["live"].heals[0]["step"] == out["restored"]
        # Healed to the survivor's parameters, then both ran the next step on the same averaged gradient.
        for a, b in zip(s_model.parameters(), out["model"].parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        for live in (survivor, out.get("live")):
            if live is not None:
                live.close()
        server.shutdown()
