"""Stacks of a hang are grouped by the thread that runs the training function, not the main thread.

Under Ray Train a rank's main thread idles in Ray's worker loop on every rank; grouping by it puts
every rank in one group and names no culprit unless its process is stopped. A hang inside user
code (a dead lock in data loading) leaves the process *running*: only the training thread tells.
The last test dumps real processes with the real py-spy.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.recovery.stacks import (
    group_stacks,
    signature,
    threads,
    training_thread,
    training_thread_first,
)
from vigil.contract.schemas import TRAINING_THREAD

RAY_MAIN = (
    'Thread 100 (idle): "MainThread"\n'
    "    main_loop (ray/_private/worker.py:900)\n"
    "    <module> (ray/_private/workers/default_worker.py:300)\n"
)


def _dump(train_frames: list[str], *, state: str = "sleeping", name: str = TRAINING_THREAD) -> str:
    frames = "".join(f"    {f}\n" for f in train_frames)
    return (
        f"# process state: {state}\nProcess 7: ray::RayTrainWorker\nPython v3.11.7\n\n" + RAY_MAIN
        + 'Thread 101 (idle): "ray_print_logs"\n    wait (threading.py:320)\n'
        + f'Thread 102 (active): "{name}"\n' + frames
    )


WAITING = ["wait (vigil/comm.py:40)", "all_reduce (vigil/comm.py:80)", "step (vigil/sdk.py:10)",
           "train_loop_per_worker (vigil/runner.py:150)"]
DEADLOCK = ["acquire (threading.py:100)", "load_batch (user/data.py:12)", "train (user/train.py:30)",
            "train_loop_per_worker (vigil/runner.py:150)"]


def test_threads_are_parsed_with_names_and_frames() -> None:
    preamble, ts = threads(_dump(WAITING))
    assert preamble.startswith("# process state: sleeping")
    assert [t.name for t in ts] == ["MainThread", "ray_print_logs", TRAINING_THREAD]
    assert ts[2].frames[:2] == ("wait (comm.py)", "all_reduce (comm.py)")
    assert training_thread(ts) is ts[2]


def test_a_running_rank_deadlocked_in_user_code_is_named_not_grouped_with_the_rest() -> None:
    stacks = {0: _dump(WAITING), 1: _dump(DEADLOCK), 2: _dump(WAITING), 3: _dump(WAITING)}
    # Grouped by the main thread every rank would look the same:
    assert len({s.split('"MainThread"')[1].split("Thread")[0] for s in stacks.values()}) == 1
    groups, odd = group_stacks(stacks)
    assert odd == [1]
    assert [g.ranks for g in groups] == [[0, 2, 3], [1]]
    assert groups[1].signature.startswith("acquire (threading.py) < load_batch (data.py)")
    assert groups[1].thread == TRAINING_THREAD
    # The sample shows the training thread first, after the process lines.
    body = groups[1].sample.split("\n\n", 1)[1] if "\n\n" in groups[1].sample else groups[1].sample
    assert body.splitlines()[0] == f'Thread 102 (active): "{TRAINING_THREAD}"'
    assert groups[1].sample.startswith("# process state: sleeping")


def test_the_runner_frames_find_the_training_thread_when_its_name_is_lost() -> None:
    dump = _dump(DEADLOCK, name="Thread-3 (run)")
    assert signature(dump).startswith("acquire (threading.py) < load_batch (data.py)")


def test_without_a_training_thread_the_main_thread_is_used() -> None:
    dump = 'Thread 1 (idle): "MainThread"\n    forward (model.py:3)\n    main (train.py:9)\n'
    assert signature(dump) == "forward (model.py) < main (train.py)"
    assert training_thread_first(dump) == dump


def test_reordering_keeps_every_thread() -> None:
    dump = _dump(WAITING)
    out = training_thread_first(dump)
    assert sorted(out.split("\n")) == sorted((dump if dump.endswith("\n") else dump + "\n").split("\n"))
    assert out.index(TRAINING_THREAD) < out.index("MainThread")


# -- real processes, real py-spy -------------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time

    def wait_for_peers():          # stands for a collective's wait
        while True:
            time.sleep(0.05)

    def all_reduce():
        wait_for_peers()

    def load_batch(lock):          # a dead lock in the user's data loading
        lock.acquire()

    def train(deadlock):
        threading.current_thread().name = sys.argv[2]
        if deadlock:
            lock = threading.Lock()
            lock.acquire()
            load_batch(lock)
        all_reduce()

    def main_loop():               # stands for Ray's worker loop on the main thread
        while True:
            time.sleep(0.05)

    t = threading.Thread(target=train, args=(sys.argv[1] == "1",), daemon=True)
    t.start()
    print("ready", flush=True)
    main_loop()
    """
)


def _pyspy() -> str:
    candidate = Path(sys.executable).parent / "py-spy"
    if not candidate.is_file():
        pytest.skip("py-spy is not installed beside this python (make installs it)")
    return str(candidate)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = [
        subprocess.Popen([sys.executable, str(script), "1" if r == 2 else "0", TRAINING_THREAD],
                         stdout=subprocess.PIPE, text=True)
        for r in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # let every training thread reach its wait
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_real_pyspy_dumps_name_the_deadlocked_rank(ranks: list[subprocess.Popen[str]]) -> None:
    binary = _pyspy()
    stacks = {}
    for rank, p in enumerate(ranks):
        r = subprocess.run([binary, "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60,
                           check=False)
        assert r.returncode == 0, r.stderr
        stacks[rank] = r.stdout
    # Every process is running and its main thread is in the same place: only the training thread tells.
    groups, odd = group_stacks(stacks)
    assert odd == [2], [g.signature for g in groups]
    assert "load_batch" in groups[1].signature and groups[1].ranks == [2]
    assert "all_reduce" in groups[0].signature and groups[0].ranks == [0, 1, 3]
    assert training_thread_first(stacks[2]).index(TRAINING_THREAD) < training_thread_first(stacks[2]).index("MainThread")
