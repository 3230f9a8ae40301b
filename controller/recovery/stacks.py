"""Group py-spy stacks of a job's ranks so that the odd rank out is named.

A hung job looks like this: every healthy rank waits inside the same collective, the culprit is
somewhere else (stopped mid-compute, stuck in I/O, in another collective). Stacks are compared by
their innermost frames (function names, not line numbers or addresses, which differ between ranks
for no reason); the ranks outside the largest group are the suspects.
"""

from __future__ import annotations

import re
from collections import defaultdict

from controller.schemas import StackGroup

_FRAME = re.compile(r"^\s+(\S+)\s+\(([^:)]+)")
_THREAD = re.compile(r"^Thread\s")
DEPTH = 6


def signature(stack: str, depth: int = DEPTH) -> str:
    """The innermost ``depth`` frames of the main thread, as ``function (file)`` joined by `` < ``."""
    frames: list[str] = []
    in_main = False
    for line in stack.splitlines():
        if _THREAD.match(line):
            if in_main:
                break  # only the first (main) thread
            in_main = True
            continue
        m = _FRAME.match(line)
        if m and in_main:
            frames.append(f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})")
    if not frames:
        return stack.strip().splitlines()[0][:200] if stack.strip() else "<empty>"
    return " < ".join(frames[:depth])


_STATE = re.compile(r"^# process state: (\S+)")
SUSPECT_STATES = {"stopped", "tracing-stop", "disk-sleep", "zombie", "dead"}


def process_state(stack: str) -> str | None:
    m = _STATE.match(stack)
    return m.group(1) if m else None


def group_stacks(stacks: dict[int, str]) -> tuple[list[StackGroup], list[int]]:
    """Groups by signature, largest first, and the suspects: ranks outside the largest group.

    A rank whose process is stopped or stuck in uninterruptible sleep (the agent reports the state
    beside the stack) is a suspect whatever its stack says: it may have stopped inside a collective.
    """
    groups, odd = _group(stacks)
    stuck = sorted(r for r, text in stacks.items() if process_state(text) in SUSPECT_STATES)
    if stuck:
        return groups, stuck
    return groups, odd


def _group(stacks: dict[int, str]) -> tuple[list[StackGroup], list[int]]:
    by_sig: dict[str, list[int]] = defaultdict(list)
    for rank, text in sorted(stacks.items()):
        by_sig[signature(text)].append(rank)
    groups = sorted(
        (StackGroup(signature=sig, ranks=ranks, sample=stacks[ranks[0]][:4000]) for sig, ranks in by_sig.items()),
        key=lambda g: (-len(g.ranks), g.ranks[0]),
    )
    if len(groups) <= 1:
        return groups, []
    if len(groups[0].ranks) == len(groups[1].ranks):
        # No majority (e.g. two ranks, two stacks): the stack that is not in a collective is the odd one.
        waiting = [g for g in groups if _in_collective(g.signature)]
        others = [r for g in groups if not _in_collective(g.signature) for r in g.ranks]
        return groups, sorted(others) if waiting and others else []
    return groups, sorted(r for g in groups[1:] for r in g.ranks)


_COLLECTIVE_HINTS = ("all_reduce", "allreduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
                     "wait", "_comm", "comm.py")


def _in_collective(sig: str) -> bool:
    return any(h in sig for h in _COLLECTIVE_HINTS)
