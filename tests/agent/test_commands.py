"""The command runner's HTTP side, unit level: a fake controller queue and fake executors.

Needs nothing but the agent package. What each command does to real processes and files is in
``test_command_kinds.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx

from agent.commands import CommandExecutor, CommandLoop, CommandRunner, ExecutorConfig
from controller.client import ApiError
from controller.schemas import CommandKind, CommandResult
from tests.agent.doubles import FakeController, command

NODE = "vigil-node-1"


class RecordingExecutor:
    """Records what it runs; ``slow`` kinds sleep ``delay`` s (longer than their timeout)."""

    def __init__(self, timeout: float = 5.0, slow: frozenset[str] = frozenset(), delay: float = 0.0) -> None:
        self.ran: list[tuple[str, dict[str, Any]]] = []
        self.timeout = timeout
        self.slow = slow
        self.delay = delay
        self.closed = False

    def run(self, kind: str | CommandKind, args: Mapping[str, Any]) -> CommandResult:
        name = kind.value if isinstance(kind, CommandKind) else kind
        self.ran.append((name, dict(args)))
        if name in self.slow:
            time.sleep(self.delay)
        return CommandResult(ok=True, message=f"did {name}", output={"n": len(self.ran)})

    def timeout_s(self, kind: str | CommandKind, args: Mapping[str, Any]) -> float:
        return self.timeout

    def close(self) -> None:
        self.closed = True


def runner_for(ctl: FakeController, ex: RecordingExecutor | None = None, **kw: Any) -> CommandRunner:
    return CommandRunner(NODE, ctl, ex or RecordingExecutor(), log_every_s=0, **kw)


def test_each_command_runs_once_in_id_order_and_is_answered_exactly_once():
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(3, rank=3), command(1, rank=1), command(2, rank=2))
    r = runner_for(ctl, ex)
    assert r.step() is True  # did something: poll again at once
    assert [a["rank"] for _, a in ex.ran] == [1, 2, 3]
    assert ctl.posts == [1, 2, 3]
    assert r.step() is False  # nothing new
    assert r.step() is False
    assert ctl.posts == [1, 2, 3] and len(ex.ran) == 3
    assert all(res.ok and res.output["duration_s"] >= 0 for res in ctl.results.values())


def test_a_command_still_listed_after_it_was_done_is_not_redone():
    """The controller may list a command as PENDING once more (a race with our post, or the post
    was lost): the agent remembers what it did and does not do it twice."""
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(7))
    r = runner_for(ctl, ex)
    r.step()
    del ctl.results[7]  # the controller "forgot" the answer: still PENDING
    assert r.step() is False
    assert len(ex.ran) == 1 and ctl.posts == [7]


def test_a_result_that_could_not_be_posted_is_posted_later_and_the_command_not_redone():
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(1), command(2))
    ctl.fail_post = httpx.ConnectError("controller down")
    r = runner_for(ctl, ex)
    r.step()
    assert len(ex.ran) == 2 and ctl.posts == [] and r.unposted == 2
    assert r.stats.failed_posts >= 1
    ctl.fail_post = None
    r.step()
    assert ctl.posts == [1, 2] and r.unposted == 0  # in order, once each
    assert len(ex.ran) == 2


def test_a_result_the_controller_refuses_for_good_is_dropped():
    ctl = FakeController()
    ctl.add(command(1))
    ctl.fail_post = ApiError(404, "no such command")
    r = runner_for(ctl)
    r.step()
    assert r.unposted == 0 and r.stats.dropped_results == 1
    ctl.fail_post = ApiError(503, "busy")
    ctl.add(command(2))
    r.step()
    assert r.unposted == 1  # a 5xx is retried


def test_fetch_failures_are_survived():
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(1))
    ctl.fail_fetch = ApiError(502, "bad gateway")
    r = runner_for(ctl, ex)
    assert r.step() is False and ex.ran == [] and r.stats.failed_polls == 1
    ctl.fail_fetch = ValueError("garbage")
    assert r.step() is False
    ctl.fail_fetch = None
    assert r.step() is True and len(ex.ran) == 1


def test_a_slow_command_times_out_without_holding_up_the_next():
    ctl = FakeController()
    ex = RecordingExecutor(timeout=0.3, slow=frozenset({"pyspy_dump"}), delay=3.0)
    ctl.add(command(1, CommandKind.PYSPY_DUMP, job_id="j", pids={}), command(2))
    r = runner_for(ctl, ex)
    t0 = time.monotonic()
    r.step()
    assert time.monotonic() - t0 < 2.0
    assert not ctl.results[1].ok and "timed out" in ctl.results[1].message
    assert ctl.results[2].ok
    assert r.stats.timed_out == 1


def test_kill_node_is_answered_then_the_runner_stops_and_reports_the_loss():
    ctl, ex = FakeController(), RecordingExecutor()
    lost = threading.Event()
    ctl.add(command(1, CommandKind.KILL_NODE), command(2))
    r = runner_for(ctl, ex, on_node_lost=lost.set)
    r.step()
    assert lost.is_set() and r.stopped
    assert ctl.posts == [1]  # answered before the agent goes
    assert [k for k, _ in ex.ran] == ["kill_node"]  # nothing after it
    assert r.step() is False and ctl.fetches == 1


def test_kill_node_answer_is_retried_a_few_times_before_the_agent_stops():
    ctl = FakeController()
    calls = {"n": 0}
    original = ctl.post_result

    def flaky(cid: int, res: CommandResult) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.ReadTimeout("slow")
        original(cid, res)

    ctl.post_result = flaky  # type: ignore[method-assign]
    ctl.add(command(1, CommandKind.KILL_NODE))
    r = runner_for(ctl, lost_post_tries=3)
    r.step()
    assert ctl.posts == [1] and r.stopped


def test_a_command_for_another_node_is_refused():
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(1, node="vigil-node-2"))
    runner_for(ctl, ex).step()
    assert ex.ran == [] and not ctl.results[1].ok and "vigil-node-2" in ctl.results[1].message


def test_after_an_agent_restart_pending_commands_are_redone():
    """The documented limit: ids done are remembered per agent process, so a command whose answer
    was lost is done again by the next agent (every kind is safe to redo)."""
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(1))
    ctl.fail_post = httpx.ConnectError("down")
    runner_for(ctl, ex).step()
    ctl.fail_post = None
    runner_for(ctl, ex).step()  # a new agent process
    assert len(ex.ran) == 2 and ctl.posts == [1]


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


def test_the_loop_polls_every_interval_and_again_at_once_after_a_command():
    ctl, ex = FakeController(), RecordingExecutor()
    r = runner_for(ctl, ex)
    loop = CommandLoop(r, interval_s=0.2)
    loop.start()
    try:
        time.sleep(0.5)
        before = ctl.fetches
        assert 2 <= before <= 5
        ctl.add(command(1))
        deadline = time.monotonic() + 3
        while not ctl.posts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctl.posts == [1]
    finally:
        loop.stop()
    assert ex.closed  # stopping the loop ends throttles


def test_client_methods_speak_the_documented_routes():
    """controller.client: the two agent-role methods, against an in-process HTTP double."""
    from controller.client import VigilClient

    seen: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.content))
        if request.method == "GET":
            body = {"data": [command(5, CommandKind.STOP_PID, pid=123).model_dump(mode="json")], "count": 1}
            return httpx.Response(200, json=body)
        return httpx.Response(200, json={"ok": True})

    with VigilClient("http://ctl", token="t", transport=httpx.MockTransport(handler)) as c:
        got = c.node_commands(NODE)
        assert (
            got.count == 1 and got.data[0].kind is CommandKind.STOP_PID and got.data[0].args == {"pid": 123}
        )
        c.post_command_result(NODE, 5, CommandResult(ok=True, message="m", output={"state": "stopped"}))
    assert seen[0][:2] == ("GET", f"http://ctl/api/v1/nodes/{NODE}/commands?status=PENDING")
    assert seen[1][:2] == ("POST", f"http://ctl/api/v1/nodes/{NODE}/commands/5/result")
    assert b'"state":"stopped"' in seen[1][2].replace(b" ", b"")


def test_a_halted_runner_starts_no_further_command():
    ctl, ex = FakeController(), RecordingExecutor()
    ctl.add(command(1), command(2))
    r = runner_for(ctl, ex)
    original = ex.run

    def run_then_halt(kind, args):
        r.halt()  # shutdown requested while command 1 runs
        return original(kind, args)

    ex.run = run_then_halt  # type: ignore[method-assign]
    r.step()
    assert ctl.posts == [1] and len(ex.ran) == 1
    assert r.step() is False and ctl.fetches == 1
