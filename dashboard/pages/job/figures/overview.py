"""The job page's figures refreshed every tick from the overview: loss, throughput and step-time bands,
drawn whole (:func:`overview_figures`) or extended with ``dash.Patch`` (:func:`overview_patches`), both
from the declarations :data:`~dashboard.pages.job.figures.training.LOSS`,
:data:`~dashboard.pages.job.figures.training.THROUGHPUT` and
:data:`~dashboard.pages.job.figures.ranks.STEP_TIME`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dash import Patch, no_update

from dashboard.pages.job.figures.ranks import STEP_TIME, step_time_bands_figure
from dashboard.pages.job.figures.training import (
    LOSS,
    MARKER_TRACE0,
    THROUGHPUT,
    marker_points,
    overview_loss_figure,
    overview_throughput_figure,
)
from vigil.contract.schemas import MARKER_KINDS, JobOverviewPublic

EXTENDED = (LOSS, THROUGHPUT, STEP_TIME)
"""The figures :func:`overview_patches` extends, in the page's output order."""
SPARSE_FIELDS = sorted({f for fig in EXTENDED for f in fig.sparse_fields()})
"""Overview fields drawn only where they have a value: the page counts their points in the forming tail."""


def overview_figures(ov: JobOverviewPublic) -> tuple[Any, Any, Any]:
    """Loss (with the markers), throughput and step-time bands of ``ov``, drawn whole."""
    return overview_loss_figure(ov), overview_throughput_figure(ov), step_time_bands_figure(ov)


def overview_patches(ov: JobOverviewPublic, tail: int, sparse_tail: Mapping[str, int],
                     markers: int) -> tuple[Any, Any, Any]:
    """Patches of the loss, throughput and step-time bands figures from the incremental answer ``ov``:
    the ``tail`` drawn steps still forming deleted (``sparse_tail``: the points of each sparse line among
    them), ``ov``'s steps appended. The markers are redrawn whole when their number (``markers`` drawn)
    changed: the overview returns all of them, whatever ``since_step``. Figures that do not change
    come back as ``dash.no_update``."""
    if not ov.step and len(ov.markers) == markers:
        return no_update, no_update, no_update
    loss: Any = Patch()
    tput: Any = no_update
    bands: Any = no_update
    if ov.step:
        LOSS.patch(ov, tail, sparse_tail, loss)
        tput, bands = THROUGHPUT.patch(ov, tail, sparse_tail), STEP_TIME.patch(ov, tail, sparse_tail)
    if len(ov.markers) != markers:
        for i, kind in enumerate(MARKER_KINDS):
            pts = marker_points(ov.markers, kind)
            trace = MARKER_TRACE0 + i
            for key, values in pts.items():
                loss["data"][trace][key] = values
            loss["data"][trace]["showlegend"] = bool(pts["x"])
    return loss, tput, bands
