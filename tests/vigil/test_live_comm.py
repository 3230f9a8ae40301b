"""Live recovery's communication layer (vigil/live.py) against a stand-in torchft manager: a failed
all-reduce is run again from this rank's own input in a new quorum, counted and timed; what live
recovery cannot do is refused by name; the job spec refuses ``live`` for optimizers that cannot heal."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from vigil.contract.schemas import LIVE_OPTIMIZERS, JobCreate
from vigil.live import RETRIES, SEQ_PER_STEP, LiveComm, LiveError, commit_step, sum_over_quorum
from vigil.live_driver import lighthouse_address


class _Work:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self) -> None:
        if self.error is not None:
            raise self.error  # as gloo's work raises when a peer died or timed out


class _Group:
    """The quorum's process group: sums with the manager's peers."""

    def __init__(self, manager: FakeManager) -> None:
        self.m = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        assert opts.reduceOp == torch.distributed.ReduceOp.SUM
        return self.m.reduce(tensors[0])

    def errored(self) -> Exception | None:
        return None


class FakeManager:
    """Sums with ``peers`` (the other replicas' contributions); fails the first ``failures`` all-reduces
    (the tensor left garbage, as a broken collective leaves it); each quorum may drop a peer."""

    def __init__(self, peers: list[float], failures: int = 0) -> None:
        self.peers = list(peers)
        self.failures = failures
        self.quorums = 0
        self._commit_failures = 0  # torchft's: a new quorum id (process groups rebuilt) when > 0
        self._errored: Exception | None = None
        self._pg = _Group(self)

    def num_participants(self) -> int:
        return 1 + len(self.peers)

    def is_participating(self) -> bool:
        return True

    def reduce(self, tensor: torch.Tensor) -> _Work:
        if self.failures > 0:
            self.failures -= 1
            tensor.fill_(float("nan"))
            return _Work(RuntimeError("peer died"))
        tensor.add_(sum(self.peers))
        return _Work()

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self) -> Any:
        return None if self._errored is None else SimpleNamespace(original_exception=self._errored)

    def start_quorum(self) -> None:
        self.quorums += 1
        self._errored = None
        self.peers = self.peers[:-1]  # the replica that failed is out of the new quorum


def test_a_failed_all_reduce_runs_again_from_the_own_input_in_the_survivors_quorum() -> None:
    m = FakeManager(peers=[10.0, 20.0], failures=1)
    comm = LiveComm(m, rank=0, world_size=3)
    comm.set_step(7)
    t = torch.full((4,), 1.0)
    comm.all_reduce(t, tag="grads")
    assert torch.equal(t, torch.full((4,), 11.0))  # 1 + 10: the dead peer's 20 is not in it, nor the NaN
    assert comm.world_size == 2 and comm.reforms == 1 and m.quorums == 1
    assert m._commit_failures == 1  # the retry's quorum rebuilds the process group the failure broke
    recs = comm.drain()
    assert [(r.step, r.seq, r.op, r.tag) for r in recs] == [(7, 0, "quorum", "reform"), (7, 1, "all_reduce", "grads")]
    assert recs[1].payload_bytes == 16 and recs[1].wire_bytes == 16  # 2 (n-1)/n x 16 bytes with n = 2


class _SlowFailure(FakeManager):
    """The first all-reduce waits ``wait_s`` (a hung peer, until the timeout) and fails; the comm's progress is
    read from inside it, as the rank's watcher thread reads it."""

    def __init__(self, comm_box: list[LiveComm], wait_s: float) -> None:
        super().__init__(peers=[1.0], failures=1)
        self.box, self.wait_s = comm_box, wait_s
        self.seen_inside: list[dict[str, Any]] = []

    def reduce(self, tensor: torch.Tensor) -> _Work:
        if self.failures > 0:
            self.seen_inside.append(self.box[0].progress())
            time.sleep(self.wait_s)
        return super().reduce(tensor)


def test_progress_numbers_each_all_reduce_by_its_step_and_a_failed_wait_is_the_reforms_time() -> None:
    box: list[LiveComm] = []
    m = _SlowFailure(box, wait_s=0.3)
    comm = LiveComm(m, rank=1, world_size=2)
    box.append(comm)
    assert comm.progress() == {"groups": [], "in_flight": [], "last_done": None}  # none run yet
    comm.set_step(3)
    before = time.time()
    comm.all_reduce(torch.ones(2))  # fails once after 0.3 s, then runs again alone
    inside = m.seen_inside[0]
    seq = 3 * SEQ_PER_STEP
    assert [(g.group, g.last_enqueued, g.last_completed) for g in inside["groups"]] == [("world", seq, -1)]
    assert [(r.group, r.seq, r.op) for r in inside["in_flight"]] == [("world", seq, "all_reduce")]
    assert before <= inside["in_flight"][0].enqueued_ts <= time.time()
    comm.all_reduce(torch.ones(2))  # the step's second: numbered after the first
    after = comm.progress()
    assert after["in_flight"] == [] and (after["last_done"].seq, after["groups"][0].last_completed) == (seq + 1, seq + 1)
    comm.set_step(4)
    comm.all_reduce(torch.ones(2))
    assert comm.progress()["last_done"].seq == 4 * SEQ_PER_STEP  # the count starts again at each step
    recs = {(r.step, r.op, r.seq): r.duration_s for r in comm.drain()}
    # The failed attempt's 0.3 s wait is the reform's, not the all-reduce's (the yardstick of a usual
    # collective that the controller's hang-from-the-collective rule takes).
    assert recs[(3, "quorum", 0)] >= 0.3 and recs[(3, "all_reduce", 1)] < 0.3


def test_average_divides_by_the_quorum_and_repeated_failures_give_up() -> None:
    comm = LiveComm(FakeManager(peers=[3.0]), rank=0, world_size=2)
    t = torch.tensor([1.0])
    comm.all_reduce(t, op=torch.distributed.ReduceOp.AVG)
    assert t.item() == 2.0
    broken = LiveComm(FakeManager(peers=[1.0] * 10, failures=RETRIES + 1), rank=0, world_size=11)
    with pytest.raises(LiveError, match="failed"):
        broken.all_reduce(torch.ones(2))


def test_what_live_recovery_cannot_do_is_refused_by_name() -> None:
    comm = LiveComm(FakeManager(peers=[1.0]), rank=0, world_size=2)
    t = torch.ones(2)
    assert comm.broadcast(t, tag="init") is t  # the first quorum heals every replica from one instead
    for call, name in [(lambda: comm.broadcast(t, tag="x"), "broadcast"),
                       (lambda: comm.all_gather_into_tensor(torch.ones(4), t), "all-gather"),
                       (lambda: comm.reduce_scatter_tensor(torch.ones(1), t), "reduce-scatter"),
                       (lambda: comm.all_to_all_single(torch.ones(2), t), "all-to-all"),
                       (lambda: comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX), "MAX")]:
        with pytest.raises(LiveError, match=name):
            call()


def test_a_heal_record_keeps_its_place_when_the_step_opens() -> None:
    comm = LiveComm(FakeManager(peers=[]), rank=0, world_size=1)
    comm.set_step(5)
    comm.record_external("heal", tag="live", payload_bytes=8, wire_bytes=0, elements=0, duration_s=0.5)
    comm.set_step(5)  # the step opens: the heal stays seq 0
    comm.all_reduce(torch.ones(1))
    assert [(r.op, r.seq) for r in comm.drain()] == [("heal", 0), ("all_reduce", 1)]


@pytest.mark.parametrize("optimizer", [{"kind": "sdp4bit"}, {"kind": "compressed_adam"}, {"kind": "powersgd"},
                                       {"kind": "dsm"}, {"kind": "slowmo", "params": {"sharded": True}}])
def test_live_is_refused_for_optimizers_that_cannot_heal_from_one_peer(optimizer: dict) -> None:
    with pytest.raises(ValidationError, match="recovery.policy: 'live' needs"):
        JobCreate.model_validate({"name": "x", "optimizer": optimizer, "recovery": {"policy": "live"}})


@pytest.mark.parametrize("kind", sorted(LIVE_OPTIMIZERS))
def test_live_is_accepted_for_all_reduce_optimizers(kind: str) -> None:
    params = {"sharded": False} if kind in ("dsm", "slowmo") else {}
    spec = JobCreate.model_validate({"name": "x", "optimizer": {"kind": kind, "params": params},
                                     "recovery": {"policy": "live"}})
    assert spec.recovery.policy.value == "live"


def test_the_lighthouse_is_reached_at_the_drivers_node_address() -> None:
    assert lighthouse_address("http://somehost:29510", "198.18.0.1") == "http://198.18.0.1:29510"
    with pytest.raises(RuntimeError, match="no port"):
        lighthouse_address("http://somehost", "198.18.0.1")


class _CommitManager(SimpleNamespace):
    """torchft's manager as :func:`commit_step` reads it (a replica group of one)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(_healing=False, _recovery_event=None, _group_world_size=1, _min_replica_size=2, _step=4,
                         _batches_committed=8, _commit_failures=0, _errored=None, pg_error=None, participants=2,
                         disallowed=0, torchft_commits=0)
        self.__dict__.update(kw)
        self._pg = SimpleNamespace(errored=lambda: self.pg_error)
        self._checkpoint_transport = SimpleNamespace(disallow_checkpoint=self._disallow)

    def _disallow(self) -> None:
        self.disallowed += 1

    def num_participants(self) -> int:
        return self.participants

    def errored(self) -> Exception | None:
        return self._errored

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def should_commit(self) -> bool:
        self.torchft_commits += 1
        return True


def test_a_step_commits_locally_as_torchft_would_and_counts_what_it_counts() -> None:
    m = _CommitManager()
    assert commit_step(m) is True
    assert (m._step, m._batches_committed, m._commit_failures, m.disallowed, m.torchft_commits) == (5, 10, 0, 1, 0)
    m.pg_error = RuntimeError("gloo: connection closed")  # the group broke after the all-reduce
    assert commit_step(m) is False
    assert (m._step, m._commit_failures) == (5, 1) and m.errored() is m.pg_error  # a new quorum id next time
    few = _CommitManager(participants=1)  # fewer replicas than min_replicas: the step does not count
    assert commit_step(few) is False and few._step == 4 and few._commit_failures == 1


@pytest.mark.parametrize("state", [{"_healing": True}, {"_recovery_event": object()}, {"_group_world_size": 2}])
def test_a_healing_replica_or_a_bigger_group_commits_through_torchft(state: dict[str, Any]) -> None:
    m = _CommitManager(**state)
    assert commit_step(m) is True and m.torchft_commits == 1 and m._step == 4  # torchft's own counts its step


def test_a_replica_outside_the_quorum_adds_zeros_and_a_failed_wait_is_reported() -> None:
    m = FakeManager(peers=[5.0])
    m.is_participating = lambda: False  # type: ignore[method-assign]
    t = torch.full((2,), 3.0)
    sum_over_quorum(m, t)
    assert torch.equal(t, torch.full((2,), 5.0)) and m.errored() is None  # its own 3 left out
    broken = FakeManager(peers=[5.0], failures=1)
    sum_over_quorum(broken, torch.ones(2))
    assert str(broken.errored().original_exception) == "peer died"
