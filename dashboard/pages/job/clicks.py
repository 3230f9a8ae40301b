"""Which ranks the job page looks at: the sample whose step breakdown it fetches for a wide job, and the
rank a click on a rank view points at (a line, a bar, a step's max, a heatmap row).

Pure functions of plain values and Plotly ``clickData``, unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SAMPLE_RANKS = 32
"""Ranks whose step breakdown the page fetches for the job-wide and per-rank views (all of them when
the job has no more; else the slowest ranks and an even spread of the others)."""


def rank_sample(ranks: int, slowest: Sequence[int], limit: int = SAMPLE_RANKS,
                include: Iterable[int] = ()) -> list[int] | None:
    """Which ranks to fetch the step breakdown of: ``None`` (all) when the job has at most ``limit``;
    else ``include`` and the slowest ranks, then an even spread over ``0..ranks-1``, ``limit`` in all."""
    if ranks <= limit:
        return None
    chosen: list[int] = []
    for r in [*include, *slowest]:
        if r not in chosen and len(chosen) < limit:
            chosen.append(r)
    spread = limit - len(chosen)
    if spread > 0:
        step = ranks / spread
        for i in range(spread):
            r = int(i * step)
            while r in chosen and r < ranks - 1:
                r += 1
            if r not in chosen:
                chosen.append(r)
    return sorted(chosen)


def parse_rank_label(label: Any) -> int | None:
    """The rank of a figure label: ``rank 5`` (maybe decorated, ``▶ rank 5 (slow)``) gives 5; a bin
    ``ranks 8-15`` gives its first rank, 8."""
    if not isinstance(label, str):
        return None
    text = label.replace("<b style='color:#d62728'>", "").replace("</b>", "").replace("▶", "")
    for word in ("ranks ", "rank "):
        if word in text:
            head = text.split(word, 1)[1].strip()
            digits = ""
            for ch in head:
                if not ch.isdigit():
                    break
                digits += ch
            return int(digits) if digits else None
    return None


def clicked_rank(click: Mapping[str, Any] | None, slowest: Sequence[int] = ()) -> int | None:
    """The rank a click on a rank view points at (Plotly ``clickData``): the ``customdata`` of a
    rank line, of a per-rank bar or of a step's max (its slowest rank), or a heatmap row's label; a
    row that bins several ranks gives the slowest of ``slowest`` inside it, else its first rank."""
    if not click or not click.get("points"):
        return None
    pt = click["points"][0]
    cd = pt.get("customdata")
    if isinstance(cd, int) and not isinstance(cd, bool):
        return cd
    label = pt.get("y") if isinstance(pt.get("y"), str) else pt.get("x")
    rank = parse_rank_label(label)
    if rank is not None and isinstance(label, str) and "ranks " in label:
        lo_hi = label.split("ranks ", 1)[1].split("-")
        try:
            lo, hi = int(lo_hi[0]), int("".join(ch for ch in lo_hi[1] if ch.isdigit()))
        except (IndexError, ValueError):
            return rank
        inside = [r for r in slowest if lo <= r <= hi]
        return inside[0] if inside else lo
    return rank
