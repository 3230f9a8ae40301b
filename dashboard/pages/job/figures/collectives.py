"""The job page's Communication tab: each kind of collective (op, group, tag) summarised over the
fetched window (:class:`KindStats`), its time per step, wait against transfer, achieved bandwidth,
and wire bits per parameter per step by tag; built by pure functions from
:class:`JobCollectivesPublic`. Kinds whose bytes are estimated (captured from torch) are marked
``(est.)`` (:mod:`dashboard.pages.job.collectives_view`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from dashboard.figures.base import WAITING_TEXT, base_layout, empty_figure
from dashboard.format import round_sig
from dashboard.pages.job.collectives_view import estimated_tags, mark_estimated
from vigil.contract.schemas import JobCollectivesPublic


@dataclass(frozen=True)
class KindStats:
    """One kind of collective (op, group, tag) over the fetched window of steps."""

    op: str
    group: str
    tag: str
    steps: int
    calls_per_step: float
    p50_s: float
    """Mean over steps of the median rank's time in this kind per step."""
    max_s: float
    """Max over steps of the slowest rank's time."""
    slowest_rank: int | None
    """The rank most often the slowest."""
    transfer_s: float
    """Mean per step of the transfer time (the fastest rank's duration, summed over calls)."""
    wait_p50_s: float
    wait_max_s: float
    payload_bytes_per_rank: float
    """Mean per step and rank of the bytes handed to the collectives."""
    wire_bytes_per_rank: float
    """Mean per step and rank of the bytes put on the wire."""
    bandwidth_bytes_per_s: float | None
    """Wire bytes per rank over the transfer time (None: no transfer time)."""
    bits_per_element: float | None
    """Wire bits per model element communicated (None: no elements reported)."""
    estimated: bool = False
    """Bytes estimated from the op and sizes (captured from torch), not counted: the label says so."""

    @property
    def label(self) -> str:
        base = f"{self.op}/{self.tag}" if self.tag else self.op
        return mark_estimated(base if self.group in ("", "world") else f"{base} [{self.group}]", self.estimated)


def collective_stats(coll: JobCollectivesPublic | None) -> list[KindStats]:
    """Each kind of collective of ``coll`` summarised over its steps (ordered by total time, most first)."""
    out = []
    for c in coll.data if coll else []:
        n = len(c.step)
        if n == 0:
            continue
        wire_pr = [w / max(r, 1) for w, r in zip(c.wire_bytes, c.ranks, strict=False)]
        transfer = sum(c.transfer_s)
        elements = sum(c.elements)
        counts: dict[int, int] = {}
        for r in c.slowest_rank:
            counts[r] = counts.get(r, 0) + 1
        out.append(KindStats(
            op=c.op, group=c.group, tag=c.tag, steps=n, calls_per_step=sum(c.calls) / n,
            p50_s=sum(c.p50_s) / n, max_s=max(c.max_s), slowest_rank=max(counts, key=lambda r: counts[r]) if counts else None,
            transfer_s=transfer / n, wait_p50_s=sum(c.wait_p50_s) / n, wait_max_s=max(c.wait_max_s),
            payload_bytes_per_rank=sum(p / max(r, 1) for p, r in zip(c.payload_bytes, c.ranks, strict=False)) / n,
            wire_bytes_per_rank=sum(wire_pr) / n,
            bandwidth_bytes_per_s=sum(wire_pr) / transfer if transfer > 0 else None,
            bits_per_element=sum(c.wire_bytes) * 8 / elements if elements > 0 else None, estimated=c.estimated,
        ))
    return sorted(out, key=lambda k: -(k.p50_s * k.steps))


def collective_time_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind of collective: its median rank's time per step (p50) and the slowest rank's (max)."""
    if not stats:
        return empty_figure("Time in collectives")
    labels = [k.label for k in stats]
    fig = go.Figure([
        go.Bar(x=labels, y=[round_sig(k.p50_s) for k in stats], name="p50 per step", marker={"color": "#1f77b4"}),
        go.Bar(x=labels, y=[round_sig(k.max_s) for k in stats], name="max (slowest rank)", marker={"color": "#d62728"},
               customdata=[k.slowest_rank for k in stats],
               hovertemplate="%{x}: %{y:.4f} s, mostly rank %{customdata}<extra>max</extra>"),
    ])
    return base_layout(fig, "Time in collectives per step", "collective (op/tag)", "seconds", revision, barmode="group")


def collective_wait_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind: the transfer time and the median rank's wait for the others, stacked (what a faster
    network would save against what a straggler costs), and a marker at the transfer plus the most
    waiting rank's wait."""
    if not stats:
        return empty_figure("Wait vs transfer")
    labels = [k.label for k in stats]
    fig = go.Figure([
        go.Bar(x=labels, y=[round_sig(k.transfer_s) for k in stats], name="transfer", marker={"color": "#ff7f0e"}),
        go.Bar(x=labels, y=[round_sig(k.wait_p50_s) for k in stats], name="wait (p50 rank)", marker={"color": "#d62728"}),
        go.Scatter(x=labels, y=[round_sig(k.transfer_s + k.wait_max_s) for k in stats], mode="markers",
                   name="transfer + wait (max rank)", customdata=[round_sig(k.wait_max_s) for k in stats],
                   marker={"symbol": "line-ew-open", "size": 24, "color": "#7f0000", "line": {"width": 3}},
                   hovertemplate="%{x}: the most waiting rank waited %{customdata} s<extra></extra>"),
    ])
    return base_layout(fig, "Wait vs transfer per step", "collective (op/tag)", "seconds", revision, barmode="stack")


def collective_bandwidth_figure(stats: Sequence[KindStats], revision: str | None = None) -> go.Figure:
    """Per kind: achieved bandwidth per rank, wire bytes over transfer time (GB/s)."""
    shown = [k for k in stats if k.bandwidth_bytes_per_s is not None]
    if not shown:  # collectives without a transfer time are data, not a wait for it
        return empty_figure("Achieved bandwidth", "no transfer time measured" if stats else WAITING_TEXT)
    fig = go.Figure(go.Bar(x=[k.label for k in shown], y=[round_sig(k.bandwidth_bytes_per_s / 1e9) for k in shown],
                           name="GB/s per rank", marker={"color": "#17becf"}))
    return base_layout(fig, "Achieved bandwidth (wire bytes / transfer time)", "collective (op/tag)", "GB/s per rank",
                   revision)


def bits_per_element_by_tag(coll: JobCollectivesPublic | None) -> dict[str, tuple[list[int], list[float]]]:
    """Per tag (ops summed), per step: wire bits per model element, ``wire_bytes * 8 / elements``
    (steps without elements left out). 32 for fp32 sent as is; less is what compression saves."""
    acc: dict[str, dict[int, list[int]]] = {}
    for c in coll.data if coll else []:
        per = acc.setdefault(c.tag or c.op, {})
        for s, w, e in zip(c.step, c.wire_bytes, c.elements, strict=False):
            cell = per.setdefault(s, [0, 0])
            cell[0] += w
            cell[1] += e
    out = {}
    for tag, per in sorted(acc.items()):
        xs = [s for s in sorted(per) if per[s][1] > 0]
        if xs:
            out[tag] = (xs, [per[s][0] * 8 / per[s][1] for s in xs])
    return out


def bits_per_element_figure(coll: JobCollectivesPublic | None) -> go.Figure:
    """Wire bits per parameter per step, one line per tag (grads, weights, push, ...), with fp32 (32)
    as the reference: what the compressed optimizers save. A tag whose bytes are estimated is named so."""
    series = bits_per_element_by_tag(coll)
    if not series:
        return empty_figure("Bits per parameter", "no parameter counts reported" if coll and coll.data else WAITING_TEXT)
    assert coll is not None
    est = estimated_tags(coll)
    fig = go.Figure([go.Scatter(x=xs, y=[round_sig(v) for v in ys], mode="lines+markers" if len(xs) == 1 else "lines",
                                name=mark_estimated(tag, tag in est)) for tag, (xs, ys) in series.items()])
    fig.add_hline(y=32, line={"dash": "dot", "color": "#888"}, annotation_text="fp32")
    return base_layout(fig, "Wire bits per parameter per step, by tag", "step", "bits / parameter", coll.job_id,
                   yaxis={"title": {"text": "bits / parameter"}, "rangemode": "tozero"},
                   showlegend=True)  # a lone tag is named too (estimated or not)
