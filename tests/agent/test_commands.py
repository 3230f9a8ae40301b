"""The command runner's HTTP side against the REAL controller, with a recording executor.

The controller is ``create_app()`` served live (fixture ``live_controller``, :mod:`tests.live_controller`).
Commands reach a node's queue the way they do in production: a fault is injected through
``POST /jobs/{id}/faults`` and the controller's monitor fires it into an agent command for the node
that runs the rank (whose heartbeat the test posts as the agent would). The runner fetches and
answers through the real transport (``ClientCommandTransport``: ``GET /nodes/{id}/commands``,
``POST .../result`` with an agent token); what it answered is read back from the controller.
An outage is the controller going away (``stop()``) and coming back on the same port (``start()``).

The executor is a recording fake (what each command does to real processes and files is in
``test_command_kinds.py``). Where a test needs a controller that misbehaves on purpose (an error
status, a body that is not JSON, an answer that never comes), :class:`Misbehaving` stands in front
of the real one for just those requests.

Needs: the controller's dependencies (FastAPI, SQLAlchemy, uvicorn), loopback networking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, update

from agent.commands import ClientCommandTransport, CommandExecutor, CommandLoop, CommandRunner, ExecutorConfig
from controller import command_bell
from controller.db import session_scope
from controller.models import NodeCommandRow
from controller.recovery import commands
from tests.live_controller import LiveController, step_sample
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import CommandKind, CommandResult, CommandStatus, Role

NODE = "vigil-node-1"
OTHER = "vigil-node-2"
pytestmark = pytest.mark.timeout(120)


class RecordingExecutor:
    """Records what it runs; ``slow`` kinds sleep ``delay`` s (longer than their timeout).
    ``on_run``: actions done one per command run, before it is recorded (the controller going
    away while a command runs, ...)."""

    def __init__(self, timeout: float = 5.0, slow: frozenset[str] = frozenset(), delay: float = 0.0) -> None:
        self.ran: list[tuple[str, dict[str, Any]]] = []
        self.timeout = timeout
        self.slow = slow
        self.delay = delay
        self.closed = False
        self.on_run: list[Callable[[], None]] = []

    def run(self, kind: str | CommandKind, args: Mapping[str, Any]) -> CommandResult:
        name = kind.value if isinstance(kind, CommandKind) else kind
        if self.on_run:
            self.on_run.pop(0)()
        self.ran.append((name, dict(args)))
        if name in self.slow:
            time.sleep(self.delay)
        return CommandResult(ok=True, message=f"did {name}", output={"n": len(self.ran)})

    def timeout_s(self, kind: str | CommandKind, args: Mapping[str, Any]) -> float:
        return self.timeout

    def close(self) -> None:
        self.closed = True


class Misbehaving(httpx.BaseTransport):
    """STUB, for the tests that need a controller misbehaving on purpose: stands in front of the
    real controller and, for the next requests of a method, answers what ``plan[method]`` says
    instead (one entry per request): an HTTP status (with a JSON ``detail``), ``"garbage"`` (200
    with a body that is not JSON), or an exception to raise (e.g. a read timeout: the answer never
    came). With nothing planned, requests go through to the real controller."""

    def __init__(self) -> None:
        self.real = httpx.HTTPTransport()
        self.plan: dict[str, list[int | str | Exception]] = {"GET": [], "POST": []}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        planned = self.plan.get(request.method)
        if not planned:
            return self.real.handle_request(request)
        what = planned.pop(0)
        if isinstance(what, Exception):
            raise what
        if what == "garbage":
            return httpx.Response(200, content=b"<html>not json", request=request)
        assert isinstance(what, int)
        return httpx.Response(what, json={"detail": "misbehaving on purpose"}, request=request)

    def close(self) -> None:
        self.real.close()


class Queue:
    """The command queues of :data:`NODE` (and :data:`OTHER`) on the real controller.

    A PENDING job; :meth:`add` has the node's agent report a rank in a heartbeat, injects a fault on
    that rank through the API and runs one monitor pass, which queues the fault's command.
    """

    def __init__(self, live: LiveController) -> None:
        self.live = live
        self.job = live.submit_job("commands", steps=10).id
        self.clients: list[VigilClient] = []

    def add(self, fault: str = "nan_loss", rank: int = 0, node: str = NODE, **fields: Any) -> int:
        """Queue one command: ``nan_loss`` -> write_fault_file (args name the rank), ``hang_rank`` ->
        stop_pid (its agent mode), ``kill_node`` -> kill_node. Returns its id."""
        if fault in ("hang_rank", "kill_rank"):
            fields.setdefault("params", {"mode": "agent"})
        # The rank's latest step (step 0) and process, as the node's agent reports them.
        self.live.heartbeat(node, [(self.job, rank, 40_000 + rank)], [step_sample(self.job, rank, 0)])
        target = {"node_id": node} if fault == "kill_node" else {"rank": rank}
        (cmd,) = self.live.fire(self.job, fault, **target, **fields)
        assert cmd.node_id == node
        return cmd.id

    def transport(self, node: str = NODE, via: httpx.BaseTransport | None = None) -> ClientCommandTransport:
        """The agent's real command transport for ``node`` (agent token), optionally ``via`` a stub."""
        client = VigilClient(self.live.url, token=self.live.token(Role.AGENT), transport=via)
        self.clients.append(client)
        return ClientCommandTransport(client, node)

    def runner(self, ex: RecordingExecutor | None = None, transport: ClientCommandTransport | None = None,
               **kw: Any) -> CommandRunner:
        return CommandRunner(NODE, transport or self.transport(), ex or RecordingExecutor(), log_every_s=0, **kw)

    def rows(self) -> dict[int, Any]:
        return self.live.command_rows()

    def answered(self) -> list[int]:
        """Command ids in the order the controller stored their (first) answers."""
        return self.live.answered()

    def set_status(self, command_id: int, status: CommandStatus) -> None:
        with session_scope(self.live.app.state.sessions) as s:
            s.execute(update(NodeCommandRow).where(NodeCommandRow.id == command_id).values(status=status.value))

    def delete(self, command_id: int) -> None:
        with session_scope(self.live.app.state.sessions) as s:
            s.execute(delete(NodeCommandRow).where(NodeCommandRow.id == command_id))


@pytest.fixture
def queue(live_controller: LiveController) -> Iterator[Queue]:
    q = Queue(live_controller)
    yield q
    for c in q.clients:
        c.close()


class NewestFirst:
    """STUB of a controller that lists pending commands newest first (the real one lists them
    oldest first): the runner must not rely on the order. Wraps the real transport."""

    def __init__(self, real: ClientCommandTransport) -> None:
        self.real = real

    def fetch(self) -> list[Any]:
        return sorted(self.real.fetch(), key=lambda c: c.id, reverse=True)

    def post_result(self, command_id: int, result: CommandResult) -> None:
        self.real.post_result(command_id, result)


def test_each_command_runs_once_in_id_order_and_is_answered_exactly_once(queue):
    ids = [queue.add(rank=r) for r in (1, 2, 3)]
    ex = RecordingExecutor()
    r = queue.runner(ex, transport=NewestFirst(queue.transport()))  # type: ignore[arg-type]
    assert r.step() is True  # did something: poll again at once
    assert [a["rank"] for _, a in ex.ran] == [1, 2, 3]
    assert queue.answered() == ids
    assert r.step() is False  # nothing new
    assert r.step() is False
    assert queue.answered() == ids and len(ex.ran) == 3 and r.stats.posted == 3
    rows = queue.rows()
    assert all(rows[i].status == "DONE" and rows[i].result["duration_s"] >= 0 for i in ids)
    assert queue.live.pending_commands(NODE) == []


def test_a_command_still_listed_after_it_was_done_is_not_redone(queue):
    """The controller may list a command as PENDING once more (a race with our post, or the post
    was lost): the agent remembers what it did and does not do it twice."""
    cid = queue.add()
    ex = RecordingExecutor()
    r = queue.runner(ex)
    r.step()
    queue.set_status(cid, CommandStatus.PENDING)  # the controller "forgot" the answer: listed again
    assert [c.id for c in queue.live.pending_commands(NODE)] == [cid]
    assert r.step() is False
    assert len(ex.ran) == 1 and r.stats.posted == 1 and queue.answered() == [cid]


def test_a_result_that_could_not_be_posted_is_posted_later_and_the_command_not_redone(queue):
    ids = [queue.add(rank=1), queue.add(rank=2)]
    ex = RecordingExecutor(timeout=30)
    ex.on_run.append(queue.live.stop)  # the controller goes away while the first command runs
    r = queue.runner(ex)
    r.step()
    assert len(ex.ran) == 2 and r.unposted == 2
    assert r.stats.failed_posts >= 1
    queue.live.start()  # back, on the same port
    assert queue.answered() == []
    r.step()
    assert queue.answered() == ids and r.unposted == 0  # in order, once each
    assert len(ex.ran) == 2


def test_a_result_the_controller_refuses_for_good_is_dropped(queue):
    first, second = queue.add(rank=1), queue.add(rank=2)
    ex = RecordingExecutor()
    stub = Misbehaving()
    ex.on_run += [
        lambda: queue.delete(first),  # the command is gone when its answer comes: 404
        lambda: stub.plan["POST"].append(503),  # the controller cannot take the second answer yet
    ]
    r = queue.runner(ex, transport=queue.transport(via=stub))
    r.step()
    assert r.stats.dropped_results == 1  # the 404 is final ...
    assert r.unposted == 1  # ... a 5xx is retried ...
    r.step()
    assert r.unposted == 0 and queue.answered() == [second]  # ... and posted once it is answered
    assert len(ex.ran) == 2


def test_fetch_failures_are_survived(queue):
    queue.add()
    ex = RecordingExecutor()
    stub = Misbehaving()
    r = queue.runner(ex, transport=queue.transport(via=stub))
    queue.live.stop()  # connection refused
    assert r.step() is False and ex.ran == [] and r.stats.failed_polls == 1
    queue.live.start()
    stub.plan["GET"] = [502, "garbage"]  # a gateway error, then a body that is no command list
    assert r.step() is False
    assert r.step() is False and r.stats.failed_polls == 3
    assert r.step() is True and len(ex.ran) == 1


def test_a_slow_command_times_out_without_holding_up_the_next(queue):
    slow, fast = queue.add("hang_rank", rank=1), queue.add(rank=2)  # stop_pid, then write_fault_file
    ex = RecordingExecutor(timeout=0.3, slow=frozenset({"stop_pid"}), delay=3.0)
    r = queue.runner(ex)
    t0 = time.monotonic()
    r.step()
    assert time.monotonic() - t0 < 2.0
    rows = queue.rows()
    assert rows[slow].status == "FAILED" and "timed out" in (rows[slow].message or "")
    assert rows[fast].status == "DONE"
    assert r.stats.timed_out == 1


def test_kill_node_is_answered_then_the_runner_stops_and_reports_the_loss(queue):
    kill, after = queue.add("kill_node"), queue.add()
    ex = RecordingExecutor()
    lost = threading.Event()
    r = queue.runner(ex, on_node_lost=lost.set)
    r.step()
    assert lost.is_set() and r.stopped
    assert queue.answered() == [kill]  # answered before the agent goes
    assert [k for k, _ in ex.ran] == ["kill_node"]  # nothing after it
    assert [c.id for c in queue.live.pending_commands(NODE)] == [after]
    assert r.step() is False and r.stats.polls == 1


def test_kill_node_answer_is_retried_a_few_times_before_the_agent_stops(queue):
    kill = queue.add("kill_node")
    stub = Misbehaving()
    stub.plan["POST"] = [httpx.ReadTimeout("slow")]  # the first answer is never acknowledged
    r = queue.runner(transport=queue.transport(via=stub), lost_post_tries=3)
    r.step()
    assert queue.answered() == [kill] and r.stopped
    assert r.stats.failed_posts == 1 and r.stats.posted == 1


def test_a_command_for_another_node_is_refused(queue):
    """An agent wired to another node's queue (a wrong --node-id elsewhere, say) refuses what it
    finds there, and says why."""
    cid = queue.add(rank=7, node=OTHER)
    ex = RecordingExecutor()
    queue.runner(ex, transport=queue.transport(node=OTHER)).step()
    row = queue.rows()[cid]
    assert ex.ran == [] and row.status == "FAILED" and OTHER in (row.message or "")


def test_after_an_agent_restart_pending_commands_are_redone(queue):
    """The documented limit: ids done are remembered per agent process, so a command whose answer
    was lost is done again by the next agent (every kind is safe to redo)."""
    cid = queue.add()
    ex = RecordingExecutor(timeout=30)
    ex.on_run.append(queue.live.stop)
    queue.runner(ex).step()
    queue.live.start()
    queue.runner(ex).step()  # a new agent process
    assert len(ex.ran) == 2 and queue.answered() == [cid]


def test_unknown_and_unsupported_kinds_and_bad_args_are_answers(tmp_path):
    ex = CommandExecutor(ExecutorConfig(node_id=NODE, run_dir=tmp_path, storage_root=tmp_path))
    r = ex.run("reboot_machine", {})
    assert not r.ok and "reboot_machine" in r.message
    r = ex.run(CommandKind.SHAPE_NIC, {"kind": "no-such-fault"})
    assert not r.ok and r.message  # refused with a reason (agent/netfaults.py), never raised
    r = ex.run(CommandKind.KILL_PID, {"pid": "not-a-pid"})
    assert not r.ok and "pid" in r.message
    r = ex.run(CommandKind.KILL_PID, {"pid": 1})
    assert not r.ok and "pid" in r.message
    r = ex.run(CommandKind.KILL_PID, {"pid": 4242, "signal": "SIGBOGUS"})
    assert not r.ok and "SIGBOGUS" in r.message
    r = ex.run(CommandKind.WRITE_FAULT_FILE, {"job_id": "j", "rank": -1, "fault": {}})
    assert not r.ok and "rank" in r.message
    r = ex.run(CommandKind.START_RAYLET, {})
    assert not r.ok and "--ray-join-cmd" in r.message


def test_the_loop_polls_every_interval_and_again_at_once_after_a_command(queue):
    ex = RecordingExecutor()
    r = queue.runner(ex)
    loop = CommandLoop(r, interval_s=0.2)
    loop.start()
    try:
        time.sleep(0.5)
        before = r.stats.polls
        assert 2 <= before <= 5
        cid = queue.add()
        deadline = time.monotonic() + 3
        while not queue.answered() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert queue.answered() == [cid]
    finally:
        loop.stop()
    assert ex.closed  # stopping the loop ends throttles


def test_client_methods_speak_the_documented_routes(queue):
    """vigil.contract.client: the two agent-role methods, on the wire, against the real routes."""
    cid = queue.add("hang_rank", rank=3)  # stop_pid of the rank's pid
    seen: list[tuple[str, str, bytes]] = []
    real = httpx.HTTPTransport()

    class Recording(httpx.BaseTransport):  # passes every request on, unchanged
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((request.method, str(request.url), request.read()))
            return real.handle_request(request)

    url = queue.live.url
    with VigilClient(url, token=queue.live.token(Role.AGENT), transport=Recording()) as c:
        got = c.node_commands(NODE)
        assert got.count == 1 and got.data[0].kind is CommandKind.STOP_PID and got.data[0].args == {"pid": 40_003}
        c.post_command_result(NODE, cid, CommandResult(ok=True, message="m", output={"state": "stopped"}))
        assert c.node_commands(NODE).count == 0
        # The status filter is the route's, not the client's: the answered command under DONE and ALL.
        assert [(x.id, x.status.value) for x in c.node_commands(NODE, status="DONE").data] == [(cid, "DONE")]
        assert [x.id for x in c.node_commands(NODE, status=None).data] == [cid]
        assert c.node_commands(NODE, status="FAILED").count == 0
    assert seen[0][:2] == ("GET", f"{url}/api/v1/nodes/{NODE}/commands?status=PENDING")
    assert seen[-1][:2] == ("GET", f"{url}/api/v1/nodes/{NODE}/commands?status=FAILED")
    assert seen[1][:2] == ("POST", f"{url}/api/v1/nodes/{NODE}/commands/{cid}/result")
    assert b'"state":"stopped"' in seen[1][2].replace(b" ", b"")
    row = queue.rows()[cid]
    assert (row.status, row.message, row.result) == ("DONE", "m", {"state": "stopped"})


def test_a_halted_runner_starts_no_further_command(queue):
    first, _second = queue.add(rank=1), queue.add(rank=2)
    ex = RecordingExecutor()
    r = queue.runner(ex)
    ex.on_run.append(r.halt)  # shutdown requested while command 1 runs
    r.step()
    assert queue.answered() == [first] and len(ex.ran) == 1
    assert r.step() is False and r.stats.polls == 1


def _enqueue(queue: Queue) -> int:
    """A command queued as the monitor queues one, straight in the database (``Queue.add`` waits for the
    requests in flight to end first, a long poll among them)."""
    with session_scope(queue.live.app.state.sessions) as s:
        return commands.enqueue(s, NODE, CommandKind.WRITE_FAULT_FILE, {"job_id": queue.job, "rank": 0}).id


def test_a_long_poll_is_answered_the_moment_a_command_is_queued(queue, monkeypatch):
    """``wait_s``: the controller holds an empty poll and answers when a command for the node commits (its
    bell), not at the next database re-read (put off here beyond the wait: only the bell can answer early)."""
    monkeypatch.setattr(command_bell, "RECHECK_S", 60.0)
    transport = queue.transport()
    transport.wait_s = 20.0
    got: list[tuple[float, list[Any]]] = []
    poll = threading.Thread(target=lambda: got.append((time.monotonic(), transport.fetch())), daemon=True)
    poll.start()
    time.sleep(0.5)
    assert poll.is_alive()  # nothing pending: it waits
    queued_at = time.monotonic()
    cid = _enqueue(queue)
    poll.join(15)
    assert got, "the long poll was not answered when the command was queued"
    answered_at, commands = got[0]
    assert [c.id for c in commands] == [cid]
    assert answered_at - queued_at < 10  # the wait was 20 s: the bell answered it


def test_a_long_poll_with_nothing_queued_answers_empty_after_its_wait_and_its_bound_is_checked(queue):
    transport = queue.transport()
    transport.wait_s = 0.5
    t0 = time.monotonic()
    assert transport.fetch() == []
    assert time.monotonic() - t0 >= 0.5
    with VigilClient(queue.live.url, token=queue.live.token(Role.AGENT)) as c:
        with pytest.raises(ApiError) as e:
            c.node_commands(NODE, wait_s=command_bell.MAX_WAIT_S + 1)
        assert e.value.status_code == 422 and "wait_s" in str(e.value.detail)
        t0 = time.monotonic()
        assert c.node_commands(NODE, status=None, wait_s=5).count == 0  # only PENDING waits
        assert time.monotonic() - t0 < 4


def test_stopping_the_loop_does_not_wait_for_a_long_poll_under_way(queue):
    ex = RecordingExecutor()
    transport = queue.transport()
    transport.wait_s = 20.0
    r = queue.runner(ex, transport=transport)
    loop = CommandLoop(r, interval_s=0.2)
    loop.start()
    time.sleep(0.5)  # the first poll waits on the controller
    t0 = time.monotonic()
    loop.stop()
    assert time.monotonic() - t0 < 5 and ex.closed
    _enqueue(queue)  # answers the poll still under way: the halted runner carries nothing out
    time.sleep(1.0)
    assert ex.ran == [] and r.stats.polls == 1
