"""A hang named by collective: each rank's place in its collectives, lined up (what PyTorch's ``fr_trace``
analysis does offline, here live from the ranks' progress reports, :mod:`vigil.rank.watch`).

Every rank reports, per process group, the last collective it entered and the last one done, and what it
is inside now. In a hang the healthy ranks sit inside the same collective *n* of some group; a rank of that
group whose last entered collective is below *n* never entered it: that is the rank they wait for. A rank
in a different collective than its peers is named the same way (its group's newest collective is not
*n*). Pure functions over the stored reports; the hang detector puts :func:`analyse`'s answer in the
incident's evidence and names its culprit when there is exactly one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def analyse(reports: Mapping[int, Mapping[str, Any]], known: Iterable[int] = ()) -> dict[str, Any] | None:
    """``reports``: per rank ``{"step", "idle_s", "state": {"groups", "in_flight", "last_done"}}`` (one run
    attempt); ``known``: the job's ranks, those of them without a report are ``silent`` (stopped, or its
    watcher could not speak). None when no rank is inside a collective (nothing to line up)."""
    if not reports:
        return None
    entered: dict[str, dict[int, int]] = {}
    for rank, rep in reports.items():
        for g in rep["state"].get("groups") or ():
            entered.setdefault(g["group"], {})[rank] = int(g["last_enqueued"])
    # The collective the others wait in: the newest one any rank is inside, in the group where a rank
    # waits longest (the oldest open entry across ranks).
    waits: list[tuple[float, str, int, str, int]] = []
    for rank, rep in reports.items():
        for ref in rep["state"].get("in_flight") or ():
            waits.append((float(ref.get("enqueued_ts") or 0.0), ref["group"], int(ref["seq"]), ref["op"], rank))
    if not waits:
        return None
    waits.sort()
    _, group, _, _, _ = waits[0]
    in_group = [w for w in waits if w[1] == group]
    seq = max(w[2] for w in in_group)
    op = next(w[3] for w in in_group if w[2] == seq)
    waiting = sorted({w[4] for w in in_group if w[2] == seq})
    members = entered.get(group, {})
    # Every reporting rank belongs to the world; of another group, those that ran one of its collectives.
    candidates = set(reports) if group == "world" else set(members)
    not_entered = sorted(r for r in candidates if members.get(r, -1) < seq)
    ranks = {
        str(rank): {
            "step": rep.get("step"), "idle_s": rep.get("idle_s"),
            "last_done": rep["state"].get("last_done"),
            "in_flight": (rep["state"].get("in_flight") or [None])[-1],
            "entered": members.get(rank, -1),
        }
        for rank, rep in sorted(reports.items())
    }
    return {"waiting_in": {"group": group, "seq": seq, "op": op}, "waiting_ranks": waiting,
            "not_entered": not_entered, "silent": sorted(set(known) - set(reports)), "ranks": ranks}


def ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2, 5, 7-8``: a 10,000-rank job's list stays one short line."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and "-" not in out[-1] and int(out[-1]) == r - 1:
            out[-1] = f"{out[-1]}-{r}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == r - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def summary(found: Mapping[str, Any]) -> str:
    """One line for a person: who waits where, and for whom."""
    w = found["waiting_in"]
    late, silent = found["not_entered"], found.get("silent") or []
    if late:
        who = f"rank{'s' if len(late) > 1 else ''} {ranges(late)} never entered it"
    elif silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {ranges(silent)} sent no report (stopped, or cannot speak)"
    else:
        who = "every rank entered it (a transport stall, not a missing rank)"
    return f"ranks {ranges(found['waiting_ranks'])} wait in {w['op']} #{w['seq']} of group {w['group']}; {who}"
