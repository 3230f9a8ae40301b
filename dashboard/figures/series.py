"""Figures of per-step lines declared once, drawn whole or extended in place.

A figure the page extends as new steps arrive (the job page's loss, throughput and step-time bands) is
a :class:`LineFigure`: its lines (:class:`Line`: name, the source's per-step field it plots, rounding,
style) in trace order, its title and axes. From that one declaration come both the whole figure
(:meth:`LineFigure.figure`) and the ``dash.Patch`` that brings a drawn figure up to date
(:meth:`LineFigure.patch`: the points drawn for steps that were still forming deleted, the new steps
appended), so the two cannot disagree on trace order, rounding or which points a line holds; adding a
line is one entry in the declaration.

The source is any object with a ``step`` list, a ``job_id`` and the fields the lines name, aligned on
``step`` (:class:`vigil.contract.schemas.JobOverviewPublic`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from dash import Patch

from dashboard.figures.base import base_layout, empty_figure
from dashboard.format import round_sig


@dataclass(frozen=True)
class Line:
    """One trace of a :class:`LineFigure`: ``field`` of the source against its steps."""

    name: str
    field: str
    """The source's per-step list drawn (``"loss"``: ``JobOverviewPublic.loss``)."""
    digits: int | None = 4
    """Significant digits kept (:func:`dashboard.format.round_sig`); None: the values as they are."""
    sparse: bool = False
    """Drawn only at the steps where ``field`` has a value (validation loss); else at every step, a None
    being a gap."""
    customdata: str | None = None
    """A second per-step field carried as the points' ``customdata`` (the step's slowest rank)."""
    style: Mapping[str, Any] = field(default_factory=dict)
    """The other ``go.Scatter`` keywords: mode, line, fill, yaxis, hovertemplate..."""

    def points(self, src: Any) -> dict[str, list[Any]]:
        """``x``, ``y`` (and ``customdata``) of the line's points in ``src``."""
        steps, values = list(src.step), list(getattr(src, self.field))
        keep = [i for i, v in enumerate(values) if v is not None] if self.sparse else range(len(steps))
        digits = self.digits
        out = {"x": [steps[i] for i in keep],
               "y": [values[i] if digits is None else round_sig(values[i], digits) for i in keep]}
        if self.customdata is not None:
            extra = list(getattr(src, self.customdata))
            out["customdata"] = [extra[i] for i in keep]
        return out

    def trace(self, src: Any) -> go.Scatter:
        points = self.points(src)
        shown = {"showlegend": bool(points["x"])} if self.sparse else {}
        return go.Scatter(**points, name=self.name, **{**self.style, **shown})


@dataclass(frozen=True)
class LineFigure:
    """A figure of :class:`Line` s against step, in trace order, possibly followed by traces of another
    kind that the caller adds (the loss figure's markers) and updates itself."""

    lines: tuple[Line, ...]
    title: str | Callable[[Any], str]
    """Fixed, or computed from the source (and then updated by every patch)."""
    empty_title: str
    """The title of the empty figure drawn before the first step."""
    y_title: str
    x_title: str = "step"
    layout: Mapping[str, Any] = field(default_factory=dict)
    """More layout keys (a second y axis, the hover mode); they override the common ones."""

    def title_of(self, src: Any) -> str:
        return self.title(src) if callable(self.title) else self.title

    def figure(self, src: Any | None, more: Sequence[go.Scatter] = ()) -> go.Figure:
        """The whole figure of ``src``: one trace per line, in order, then ``more``; the empty figure
        while ``src`` has no step."""
        if src is None or not src.step:
            return empty_figure(self.empty_title)
        fig = go.Figure()
        for line in self.lines:
            fig.add_trace(line.trace(src))
        for trace in more:
            fig.add_trace(trace)
        return base_layout(fig, self.title_of(src), self.x_title, self.y_title, src.job_id, **self.layout)

    def patch(self, src: Any, tail: int, sparse_tail: Mapping[str, int], p: Patch | None = None) -> Patch:
        """The ``Patch`` (``p``, or a new one) that turns the figure drawn before ``src`` into the one
        :meth:`figure` would draw with ``src``'s steps added: the last ``tail`` points of every line
        deleted (steps drawn while still forming, which ``src`` holds again; a sparse line's own count
        is ``sparse_tail[field]``), then ``src``'s points appended."""
        p = Patch() if p is None else p
        points = [line.points(src) for line in self.lines]
        for i, (line, pts) in enumerate(zip(self.lines, points, strict=True)):
            for _ in range(sparse_tail.get(line.field, 0) if line.sparse else tail):
                for key in pts:  # index -1, once per point: resolved against the array as it is then
                    del p["data"][i][key][-1]
        for i, (line, pts) in enumerate(zip(self.lines, points, strict=True)):
            if not pts["x"]:
                continue
            for key, values in pts.items():
                p["data"][i][key].extend(values)
            if line.sparse:
                p["data"][i]["showlegend"] = True
        if callable(self.title):
            p["layout"]["title"]["text"] = self.title(src)
        return p

    def sparse_fields(self) -> list[str]:
        return [line.field for line in self.lines if line.sparse]
