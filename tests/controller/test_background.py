"""The background loop every Vigil service runs: passes, pauses, wake-ups, failures, restarts.

Needs: nothing (threads only).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vigil.contract.background import BackgroundLoop
from vigil.contract.probe import wait_for


class Counter(BackgroundLoop):
    thread_name = "test-loop"

    def __init__(self, interval: float = 60.0, backlog: int = 0, fail_first: bool = False) -> None:
        super().__init__()
        self.interval = interval
        self.backlog = backlog
        self.fail_first = fail_first
        self.passes = 0

    def tick(self) -> bool:
        self.passes += 1
        if self.fail_first and self.passes == 1:
            raise RuntimeError("boom")
        if self.backlog:
            self.backlog -= 1
            return True
        return False


def test_a_pass_at_start_then_only_on_wake() -> None:
    loop = Counter(interval=60)
    loop.start()
    try:
        wait_for(lambda: loop.passes == 1, 5, "the first pass")
        time.sleep(0.2)
        assert loop.passes == 1  # the pause is 60 s
        loop.wake()
        wait_for(lambda: loop.passes == 2, 5, "the woken pass")
    finally:
        loop.stop()
    assert not loop.running


def test_a_backlog_runs_back_to_back() -> None:
    loop = Counter(interval=60, backlog=5)
    loop.start()
    try:
        wait_for(lambda: loop.passes == 6, 5, "the backlog drained")
    finally:
        loop.stop()


def test_a_failed_pass_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    loop = Counter(interval=0.01, fail_first=True)
    with caplog.at_level(logging.ERROR, logger="vigil.contract.background"):
        loop.start()
        try:
            wait_for(lambda: loop.passes >= 3, 5, "passes after the failure")
        finally:
            loop.stop()
    assert any("test-loop: pass failed" in r.getMessage() for r in caplog.records)


def test_start_after_stop_runs_again_and_start_twice_is_one_thread() -> None:
    loop = Counter(interval=0.01)
    loop.start()
    loop.start()
    assert [t.name for t in threading.enumerate()].count("test-loop") == 1
    loop.stop()
    assert loop.stopping
    seen = loop.passes
    loop.start()  # the stop flag is cleared (the supervisor's used to stay set: a restart did nothing)
    try:
        wait_for(lambda: loop.passes > seen + 2, 5, "passes after a restart")
        assert not loop.stopping
    finally:
        loop.stop()


def test_stop_from_inside_a_pass_ends_the_loop_without_joining_itself() -> None:
    class StopsItself(Counter):
        def tick(self) -> bool:
            self.passes += 1
            self.stop()
            return True

    loop = StopsItself()
    loop.start()
    wait_for(lambda: loop.passes == 1 and not any(t.name == "test-loop" for t in threading.enumerate()), 5,
             "the loop to end")
    assert loop.passes == 1


def test_wait_first_pauses_before_the_first_pass() -> None:
    class Late(Counter):
        wait_first = True

    loop = Late(interval=60)
    loop.start()
    try:
        time.sleep(0.2)
        assert loop.passes == 0
        loop.wake()
        wait_for(lambda: loop.passes == 1, 5, "the first pass after wake")
    finally:
        loop.stop()
