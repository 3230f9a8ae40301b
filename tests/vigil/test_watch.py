"""The rank's collective watcher (vigil.rank.watch) on recorder dumps written by hand: what it reports
while steps stall, that it stays quiet while they don't, and that it skips Vigil's own groups.

Needs: nothing outside the venv (no process group: the dump is a fake, the clock the test's).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from vigil.contract.schemas import CollectiveRef, GroupProgress, ProgressSample
from vigil.rank.watch import STALL_MIN_S, Watcher, progress, stall_limit


def _dump() -> dict[str, Any]:
    def e(i: int, pg: str, seq: int, retired: bool) -> dict[str, Any]:
        return {"record_id": i, "process_group": (pg, "default_pg" if pg == "0" else "undefined"),
                "collective_seq_id": seq, "profiling_name": "gloo:all_reduce", "time_created_ns": (100 + i) * 10**9,
                "input_sizes": [[4]], "input_dtypes": ["Float"], "retired": retired, "state": "scheduled"}
    return {"entries": [e(0, "0", 11, True), e(1, "5", 2, True), e(2, "0", 12, False)],
            "pg_status": {"0": {"last_enqueued_collective": 12, "last_completed_collective": 11},
                          "5": {"last_enqueued_collective": 2, "last_completed_collective": 2},
                          "9": {"last_enqueued_collective": -1, "last_completed_collective": -1}}}


def test_progress_says_what_the_rank_entered_and_is_inside() -> None:
    state = progress(_dump(), exclude={"5"}, world_size=2)
    assert [(g.group, g.last_enqueued, g.last_completed) for g in state["groups"]] == [("world", 12, 11)]
    assert [(r.group, r.seq, r.op, r.enqueued_ts) for r in state["in_flight"]] == [("world", 12, "all_reduce", 102.0)]
    assert (state["last_done"].group, state["last_done"].seq) == ("world", 11)


def test_the_watcher_reports_only_while_stalled_and_not_the_same_twice_at_once() -> None:
    idle = [0.5]
    sent: list[ProgressSample] = []

    def sample(state: dict[str, Any], idle_s: float) -> ProgressSample:
        return ProgressSample(job_id="j", rank=1, attempt=2, ts=1.0, step=12, idle_s=idle_s, **state)

    w = Watcher(lambda: (idle[0], 0.1), sample, sent.append, exclude=set(), world_size=2, dump=_dump)
    assert not w.check() and not sent
    idle[0] = STALL_MIN_S + 1
    assert w.check() and sent[0].in_flight[0].seq == 12 and sent[0].idle_s == STALL_MIN_S + 1
    assert not w.check()  # the same state again at once: not resent
    assert stall_limit(10.0) == 30.0 and stall_limit(0.01) == STALL_MIN_S


def test_a_failing_start_of_stall_hook_does_not_keep_the_report_back_nor_a_failing_dump_the_hook() -> None:
    """The report goes first and on its own; the stall's hook (the held steps) runs once a stall, either way."""
    calls: list[str] = []
    sent: list[ProgressSample] = []

    def sample(state: dict[str, Any], idle_s: float) -> ProgressSample:
        return ProgressSample(job_id="j", rank=1, attempt=2, ts=1.0, step=12, idle_s=idle_s, **state)

    def hook() -> None:
        calls.append("hook")
        raise RuntimeError("held steps could not go")

    idle = [STALL_MIN_S + 1]
    w = Watcher(lambda: (idle[0], 0.1), sample, lambda s: (calls.append("report"), sent.append(s)), exclude=set(),
                world_size=2, dump=_dump, on_stall=hook)
    assert w.check() and calls == ["report", "hook"] and sent[0].in_flight[0].seq == 12
    assert not w.check() and calls == ["report", "hook"]  # once a stall

    def broken() -> dict[str, Any]:
        raise RuntimeError("recorder unreadable")

    idle[0] = 0.0
    assert not w.check()  # steps flow again: the next stall is a new one
    idle[0] = STALL_MIN_S + 1
    w.dump = broken
    with pytest.raises(RuntimeError, match="recorder unreadable"):  # to the thread's loop, which logs it
        w.check()
    assert calls == ["report", "hook", "hook"]


def test_a_state_source_replaces_the_recorder() -> None:
    """Live recovery's all-reduces (vigil.live.LiveComm.progress), which torch's recorder does not see."""
    sent: list[ProgressSample] = []

    def sample(state: dict[str, Any], idle_s: float) -> ProgressSample:
        return ProgressSample(job_id="j", rank=0, attempt=1, ts=1.0, step=9, idle_s=idle_s, **state)

    def unread() -> dict[str, Any]:
        raise AssertionError("the recorder is not read when a state source is given")

    live = {"groups": [GroupProgress(group="world", last_enqueued=9 << 20, last_completed=(8 << 20) + 1)],
            "in_flight": [CollectiveRef(group="world", seq=9 << 20, op="all_reduce", enqueued_ts=5.0)], "last_done": None}
    w = Watcher(lambda: (STALL_MIN_S + 1, 0.1), sample, sent.append, exclude=set(), world_size=2, dump=unread,
                state=lambda: live)
    assert w.check() and sent[0].in_flight[0].seq == 9 << 20 and sent[0].groups[0].last_completed == (8 << 20) + 1


def test_the_tick_runs_after_every_look_stalled_or_not_and_a_failing_one_stops_nothing() -> None:
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 1:
            raise OSError("agent gone")

    def sample(state: dict[str, Any], idle_s: float) -> ProgressSample:
        return ProgressSample(job_id="j", rank=0, attempt=1, ts=1.0, step=1, idle_s=idle_s, **state)

    w = Watcher(lambda: (0.0, 0.1), sample, lambda s: None, exclude=set(), world_size=2, dump=_dump,
                period_s=0.01, tick=tick).start()
    deadline = time.monotonic() + 5
    while len(ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop()
    assert len(ticks) >= 3  # not stalled (idle 0): ticked anyway, and on after the first one failed
