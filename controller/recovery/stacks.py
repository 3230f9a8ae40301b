"""Group py-spy stacks of a job's ranks so that the odd rank out is named.

A hung job looks like this: every healthy rank waits inside the same collective, the culprit is
somewhere else (stopped mid-compute, stuck in I/O, in another collective). Stacks are compared by
the innermost frames of the thread that runs the training function (function names, not line
numbers or addresses, which differ between ranks for no reason); the ranks outside the largest
group are the suspects. Which thread: the one Vigil's runner names ``TRAINING_THREAD``; under Ray
Train the main thread idles in Ray's worker loop on every rank and would put all ranks in one group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from vigil.contract.schemas import TRAINING_THREAD, StackGroup

_FRAME = re.compile(r"^\s+(\S+)\s+\(([^:)]+)")
_THREAD = re.compile(r'^Thread\s+(\S+)\s*(?:\(([^)]*)\))?:?\s*(?:"(.*)")?')
DEPTH = 6
#: Frames of Vigil's runner: a thread showing one runs the training function (when its name was lost).
_RUNNER_FRAMES = ("train_loop_per_worker (runner.py)", "run_entrypoint (runner.py)")


@dataclass(frozen=True)
class Thread:
    """One thread of a py-spy dump: its header line, name and frames (``function (file)``, innermost first)."""

    header: str
    name: str
    frames: tuple[str, ...]
    text: str


def threads(stack: str) -> tuple[str, list[Thread]]:
    """The dump's preamble (process line, ``# process state``) and its threads in dump order."""
    preamble: list[str] = []
    out: list[Thread] = []
    header: str | None = None
    name = ""
    lines: list[str] = []
    frames: list[str] = []
    for line in stack.splitlines():
        m = _THREAD.match(line)
        if m:
            if header is not None:
                out.append(Thread(header, name, tuple(frames), "\n".join(lines)))
            header, name, lines, frames = line, m.group(3) or "", [line], []
            continue
        if header is None:
            preamble.append(line)
            continue
        lines.append(line)
        f = _FRAME.match(line)
        if f:
            frames.append(f"{f.group(1)} ({f.group(2).rsplit('/', 1)[-1]})")
    if header is not None:
        out.append(Thread(header, name, tuple(frames), "\n".join(lines)))
    return "\n".join(preamble), out


def training_thread(ts: list[Thread]) -> Thread | None:
    """The thread that runs the training function: the one Vigil named (``TRAINING_THREAD``), else one
    showing Vigil's runner frames, else the first (main) thread."""
    for t in ts:
        if t.name == TRAINING_THREAD:
            return t
    for t in ts:
        if any(f in _RUNNER_FRAMES for f in t.frames):
            return t
    return ts[0] if ts else None


def signature(stack: str, depth: int = DEPTH) -> str:
    """The innermost ``depth`` frames of the training thread, as ``function (file)`` joined by `` < ``."""
    t = training_thread(threads(stack)[1])
    if t is None or not t.frames:
        return stack.strip().splitlines()[0][:200] if stack.strip() else "<empty>"
    return " < ".join(t.frames[:depth])


def training_thread_first(stack: str) -> str:
    """The dump with the training thread moved first (after the preamble); other threads in their order."""
    preamble, ts = threads(stack)
    t = training_thread(ts)
    if t is None or ts[0] is t:
        return stack
    ordered = [t, *(x for x in ts if x is not t)]
    return "\n".join(([preamble] if preamble else []) + [x.text for x in ordered]) + "\n"


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
        (StackGroup(signature=sig, ranks=ranks, sample=training_thread_first(stacks[ranks[0]])[:4000],
                    thread=_thread_name(stacks[ranks[0]])) for sig, ranks in by_sig.items()),
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


def _thread_name(stack: str) -> str:
    t = training_thread(threads(stack)[1])
    return t.name if t is not None else ""


_COLLECTIVE_HINTS = ("all_reduce", "allreduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
                     "wait", "_comm", "comm.py")


def _in_collective(sig: str) -> bool:
    return any(h in sig for h in _COLLECTIVE_HINTS)
