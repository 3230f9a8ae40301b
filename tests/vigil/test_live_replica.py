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
from vigil.live_trust import new_key

JOIN_TIMEOUT_MS = 300
KEY = new_key()
"""The run's heal key, which both replicas of a test hold (the driver draws one per run)."""
COLLECTIVE_TIMEOUT_S = 2.0
"""The survivor's all-reduce in the quorum whose heal failed waits this long for the replacement (which
asks for a new quorum instead); the next quorum must rebuild the process group that timed out."""


def _replica(rank: int, lighthouse: str, *, replacement: bool, value: float,
             quorum_every: int = 1) -> tuple[LiveReplica, torch.nn.Linear]:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    live = LiveReplica(rank=rank, world_size=2, min_replicas=1, lighthouse=lighthouse, host="127.0.0.1",
                       replica_prefix="test_", heal_key=KEY, replacement=replacement, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                       quorum_every=quorum_every)
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


def test_with_every_replica_in_a_quorum_opens_every_k_steps_and_the_replicas_stay_identical() -> None:
    """``recovery.quorum_every_steps``: two replicas, a quorum every 5 steps (restore's is step 1's); the steps
    between run on the last quorum's process group, and both end with the same parameters at step 12."""
    torch.set_num_threads(1)
    server = start_lighthouse(1, bind="127.0.0.1:0", join_timeout_ms=5000)
    pairs = [_replica(r, server.address(), replacement=False, value=float(r), quorum_every=5) for r in (0, 1)]
    errors: list[BaseException] = []

    def run(live: LiveReplica, model: torch.nn.Linear) -> None:
        try:
            live.restore(lambda: 0)
            for n in range(1, 13):
                _step(live, model, n)
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            errors.append(e)

    threads = [threading.Thread(target=run, args=pair, daemon=True) for pair in pairs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, repr(errors)
        assert not any(t.is_alive() for t in threads)
        (a, ma), (b, mb) = pairs
        assert a.quorums == b.quorums == 2  # steps 5 and 10
        assert a.manager.current_step() == b.manager.current_step() == 12
        assert a.manager.num_participants() == 2
        for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
            assert torch.equal(pa, pb)  # healed to one state at the first quorum, then the same averaged steps
    finally:
        for live, _ in pairs:
            live.close()
        server.shutdown()


def test_while_a_replica_is_missing_every_step_opens_with_a_quorum() -> None:
    """A replica alone in a world of two asks at every step (its peer's replacement joins at the next one)."""
    torch.set_num_threads(1)
    server = start_lighthouse(1, bind="127.0.0.1:0", join_timeout_ms=JOIN_TIMEOUT_MS)
    live, model = _replica(0, server.address(), replacement=False, value=1.0, quorum_every=5)
    try:
        assert live.restore(lambda: 0) == 0
        assert live.manager.num_participants() == 1
        assert [live.quorum_due(n) for n in (2, 3, 5)] == [True, True, True]
        for n in range(1, 7):
            _step(live, model, n)
        assert live.quorums == 5  # steps 2 to 6 (step 1 ran in restore's quorum)
    finally:
        live.close()
        server.shutdown()
