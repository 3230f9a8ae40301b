"""Unit tests of the figure layer's line declarations (dashboard/figures/series.py): one declaration
gives the whole figure and the ``dash.Patch`` that extends it, and they agree for any line added.

Needs: dash and plotly only (no server, no browser). A patch is checked by applying it to the figure it
extends, as the browser does, and comparing with the figure drawn whole.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from dashboard.figures.base import WAITING_TEXT
from dashboard.figures.series import Line, LineFigure


@dataclass
class _Src:
    """A source as the overview is: per-step lists aligned on ``step``."""

    step: list[int]
    a: list[float | None]
    b: list[float | None] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    job_id: str = "j"


def _src(steps: range, every: int = 3) -> _Src:
    xs = list(steps)
    return _Src(step=xs, a=[1.0 / (1 + s) for s in xs], b=[float(s) if s % every == 0 else None for s in xs],
                 rank=[s % 4 for s in xs])


FIG = LineFigure(
    lines=(Line("a", "a", digits=3, customdata="rank", style={"mode": "lines"}),
           Line("b", "b", digits=None, sparse=True, style={"mode": "markers"})),
    title=lambda src: f"{len(src.step)} steps", empty_title="A and B", y_title="value",
    layout={"hovermode": "x unified"},
)


def _apply(fig: dict[str, Any], patch: Any) -> dict[str, Any]:
    out = copy.deepcopy(fig)
    for op in patch.to_plotly_json()["operations"]:
        *path, last = op["location"]
        node = out
        for key in path:
            node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
        if op["operation"] == "Assign":
            node[last] = op["params"]["value"]
        elif op["operation"] == "Delete":
            del node[last]
        else:
            node[last] = list(node.get(last) or []) + list(op["params"]["value"])
    return out


def _lines(fig: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: list(t.get(k) or []) for k in ("x", "y", "customdata")} | {"legend": t.get("showlegend")}
            for t in fig["data"]]


def test_the_whole_figure_follows_the_declaration() -> None:
    fig = FIG.figure(_src(range(7)))
    a, b = fig.data
    assert (a.name, b.name) == ("a", "b") and a.mode == "lines" and b.mode == "markers"
    assert list(a.y) == [1.0, 0.5, 0.333, 0.25, 0.2, 0.167, 0.143] and list(a.customdata) == [0, 1, 2, 3, 0, 1, 2]
    assert list(b.x) == [0, 3, 6] and list(b.y) == [0.0, 3.0, 6.0] and b.showlegend is True
    assert fig.layout.title.text == "7 steps" and fig.layout.hovermode == "x unified"
    empty = FIG.figure(_src(range(0)))
    assert empty.layout.title.text == "A and B" and [a.text for a in empty.layout.annotations] == [WAITING_TEXT]


def test_a_patch_gives_what_the_whole_figure_draws_with_a_forming_tail_redrawn() -> None:
    first = _src(range(8))  # steps 6 and 7 were still forming: one point of b (step 6) among them
    drawn = FIG.figure(first).to_plotly_json()
    newer = _src(range(6, 12))
    newer.a[0] = 0.5  # step 6 settled to another value
    patch = FIG.patch(newer, tail=2, sparse_tail={"b": 1})
    whole = _src(range(12))
    whole.a[6] = 0.5
    patched = _apply(drawn, patch)
    assert _lines(patched) == _lines(FIG.figure(whole).to_plotly_json())
    assert patched["layout"]["title"]["text"] == "6 steps"  # a computed title follows the patch's source


def test_a_sparse_line_with_nothing_new_is_left_alone() -> None:
    drawn = FIG.figure(_src(range(3))).to_plotly_json()
    patch = FIG.patch(_src(range(3, 5), every=10), tail=0, sparse_tail={})
    patched = _apply(drawn, patch)
    assert patched["data"][1]["x"] == [0] and patched["data"][0]["x"] == [0, 1, 2, 3, 4]
