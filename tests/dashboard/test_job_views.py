"""Unit tests of the job page's logic (dashboard/pages/job/: cursor.py, figures/overview.py, joins.py,
clicks.py): the incremental refresh (cursor, ``dash.Patch``),
ETA, rank sampling and clicks, and the joins between incidents and faults, restarts and checkpoints.

Needs: dash and the wire schemas only (no server, no browser). The patches are checked by applying
them to the figure they extend and comparing with the figure built from scratch.
"""

from __future__ import annotations

import copy
import itertools
from datetime import timedelta
from typing import Any

import pytest
from dash import Patch

from dashboard.pages.job import clicks, joins
from dashboard.pages.job import cursor as job_cursor
from dashboard.pages.job.cursor import Cursor
from dashboard.pages.job.figures import ranks as rank_figures
from dashboard.pages.job.figures import training as training_figures
from dashboard.pages.job.figures.overview import overview_patches
from tests.dashboard import job_samples as js
from vigil.contract.schemas import EventPublic, FaultKind, FaultStatus, IncidentStatus


def _apply(fig: dict[str, Any], patch: Any) -> dict[str, Any]:
    """Apply a ``dash.Patch`` (its Assign and Extend operations) to a figure dict, as the renderer does."""
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
        elif op["operation"] == "Extend":
            node.setdefault(last, [])
            node[last] = list(node[last]) + list(op["params"]["value"])
        else:  # pragma: no cover - the page uses only these two
            raise AssertionError(op)
    return out


def _patches(ov: Any, cursor: Cursor) -> tuple[Any, Any, Any]:
    return overview_patches(ov, cursor.tail, cursor.tail_sparse, cursor.markers)


def _traces(fig: dict[str, Any], *keys: str) -> list[dict[str, list[Any]]]:
    return [{k: list(t.get(k) or []) for k in keys} for t in fig["data"]]


def test_patches_extend_the_figures_to_what_a_full_rebuild_draws() -> None:
    first = js.overview(steps=range(10), val_every=4, markers=[js.marker("checkpoint", 5)])
    cursor = job_cursor.advance(None, first, full=True)
    assert (cursor.last_step, cursor.points, cursor.markers, cursor.restarts) == (9, 10, 1, 0)
    assert job_cursor.since_step(cursor) == 10

    more_markers = [js.marker("checkpoint", 5), js.marker("incident", 12, ref="3")]
    newer = js.overview(steps=range(10, 15), val_every=4, markers=more_markers)
    assert not job_cursor.needs_rebuild(cursor, newer)
    loss_p, tput_p, bands_p = _patches(newer, cursor)

    whole = js.overview(steps=range(15), val_every=4, markers=more_markers)
    for build, patch in ((training_figures.overview_loss_figure, loss_p),
                         (training_figures.overview_throughput_figure, tput_p),
                         (rank_figures.step_time_bands_figure, bands_p)):
        patched = _apply(build(first).to_plotly_json(), patch)
        expected = build(whole).to_plotly_json()
        assert _traces(patched, "x", "y", "customdata") == _traces(expected, "x", "y", "customdata"), build.__name__
    loss = _apply(training_figures.overview_loss_figure(first).to_plotly_json(), loss_p)
    incident = loss["data"][training_figures.MARKER_TRACE0 + 2]
    assert incident["name"] == "incident" and incident["x"] == [12] and incident["showlegend"] is True
    assert loss["data"][1]["x"] == [0, 4, 8, 12]  # validation points appended

    after = job_cursor.advance(cursor, newer, full=False)
    assert (after.last_step, after.points, after.markers, after.tick) == (14, 15, 2, 2)


def test_steps_still_forming_are_drawn_again_once_complete() -> None:
    first = js.overview(steps=range(10), val_every=4, forming=2)  # steps 8 and 9 not complete yet
    cursor = job_cursor.advance(None, first, full=True)
    assert (cursor.resume, cursor.tail, cursor.tail_sparse, cursor.points) == (8, 2, {"val_loss": 1}, 10)
    assert job_cursor.since_step(cursor) == 8  # ask for them again

    newer = js.overview(steps=range(8, 15), val_every=4, forming=1)
    assert not job_cursor.needs_rebuild(cursor, newer)
    patches = _patches(newer, cursor)
    whole = js.overview(steps=range(15), val_every=4, forming=1)
    for build, patch in zip((training_figures.overview_loss_figure, training_figures.overview_throughput_figure,
                             rank_figures.step_time_bands_figure), patches, strict=True):
        patched = _apply(build(first).to_plotly_json(), patch)
        assert _traces(patched, "x", "y", "customdata") == _traces(build(whole).to_plotly_json(), "x", "y",
                                                                   "customdata"), build.__name__
    after = job_cursor.advance(cursor, newer, full=False)
    assert (after.resume, after.tail, after.tail_sparse, after.points, after.last_step) == (14, 1, {"val_loss": 0}, 15, 14)
    assert [s for s, _ in after.recent] == list(range(15))
    # A long forming tail (no aggregation running): rebuild instead of patching.
    assert job_cursor.needs_rebuild(Cursor(job_id="job", last_step=99, resume=0, tail=100, points=100),
                                   js.overview(steps=range(100), forming=100))


def test_nothing_new_changes_no_figure() -> None:
    import dash

    cursor = job_cursor.advance(None, js.overview(steps=range(10)), full=True)
    assert _patches(js.overview(steps=range(0)), cursor) == (dash.no_update,) * 3


def test_new_markers_alone_patch_only_the_loss_markers() -> None:
    import dash

    cursor = job_cursor.advance(None, js.overview(steps=range(10)), full=True)
    loss, tput, bands = _patches(js.overview(steps=range(0), markers=[js.marker("fault", 9)]), cursor)
    assert isinstance(loss, Patch) and tput is dash.no_update and bands is dash.no_update
    ops = loss.to_plotly_json()["operations"]
    marker4 = training_figures.MARKER_TRACE0 + 4
    assert {"operation": "Assign", "location": ["data", marker4, "x"], "params": {"value": [9]}} in ops


def test_rebuild_on_first_load_after_a_restart_or_when_too_long() -> None:
    ov = js.overview(steps=range(10))
    assert job_cursor.needs_rebuild(None, ov)
    assert job_cursor.needs_rebuild(Cursor(job_id="job"), ov)  # nothing drawn yet
    cursor = job_cursor.advance(None, ov, full=True)
    assert not job_cursor.needs_rebuild(cursor, js.overview(steps=range(10, 12)))
    restarted = js.overview(steps=range(0), markers=[js.marker("restart", 30)])
    assert job_cursor.needs_rebuild(cursor, restarted)  # re-run steps: the drawn ones are stale
    long = Cursor(job_id="job", last_step=9, points=job_cursor.MAX_DRAWN_POINTS - 1)
    assert job_cursor.needs_rebuild(long, js.overview(steps=range(10, 12)))


def test_cursor_round_trips_through_the_store_and_belongs_to_one_job() -> None:
    cursor = job_cursor.advance(None, js.overview(steps=range(40), slow=5), full=True)
    assert cursor.slowest[0] == 5 and cursor.stragglers == [5] and cursor.ranks == 12
    assert len(cursor.recent) == job_cursor.RECENT and cursor.recent[-1] == [39, js.TS0 + 39]
    stored = cursor.to_store()
    assert Cursor.from_store(stored, "job") == cursor
    assert Cursor.from_store(stored, "other-job") is None
    assert Cursor.from_store(None, "job") is None
    assert Cursor.from_store({"job_id": "job", "bogus": 1}, "job") == Cursor(job_id="job")


def test_eta_from_the_recent_pace() -> None:
    recent = [[s, 100.0 + 2 * s] for s in range(10, 20)]  # 2 s per step
    assert job_cursor.seconds_per_step(recent) == pytest.approx(2.0)
    assert job_cursor.eta_seconds(recent, 19, 100) == pytest.approx(2.0 * 80)  # steps 20..99 left
    assert job_cursor.eta_seconds(recent, 100, 100) == 0.0
    assert job_cursor.eta_seconds(recent[:1], 10, 100) is None
    assert job_cursor.eta_seconds([[5, 10.0], [5, 11.0]], 5, 100) is None


def test_live_incident_is_the_newest_open_or_acting() -> None:
    old = js.incident(1, status=IncidentStatus.ACTING, detected_s=10)
    new = js.incident(2, status=IncidentStatus.OPEN, detected_s=20)
    done = js.incident(3, status=IncidentStatus.RECOVERED, detected_s=30)
    assert joins.live_incident([old, new, done]) == new
    assert joins.live_incident([done]) is None


def test_rank_sample_keeps_the_slowest_and_spreads_the_rest() -> None:
    assert clicks.rank_sample(12, [5], limit=32) is None  # a small job: every rank
    sample = clicks.rank_sample(10_000, [9_999, 17], limit=32, include=[4_242])
    assert sample is not None and len(sample) == 32 and sample == sorted(set(sample))
    assert {9_999, 17, 4_242} <= set(sample) and 0 in sample
    assert max(b - a for a, b in itertools.pairwise(sample)) < 700  # spread over the job


@pytest.mark.parametrize(("click", "expected"), [
    ({"points": [{"x": 3, "y": "rank 5", "z": 0.5}]}, 5),
    ({"points": [{"x": 3, "y": "ranks 8-15", "z": 0.5}]}, 11),  # the slowest rank inside the bin
    ({"points": [{"x": 3, "y": "ranks 16-23", "z": 0.5}]}, 16),  # none known: its first rank
    ({"points": [{"x": 3, "y": 0.5, "customdata": 7}]}, 7),  # a step's max: its slowest rank
    ({"points": [{"x": "▶ rank 2", "y": 0.4, "customdata": 2}]}, 2),  # a per-rank bar
    ({"points": [{"x": "▶ rank 2", "y": 0.4}]}, 2),
    ({"points": []}, None),
    (None, None),
])
def test_clicked_rank(click: Any, expected: int | None) -> None:
    assert clicks.clicked_rank(click, slowest=[11, 3]) == expected


def test_parse_rank_label_strips_decoration() -> None:
    assert clicks.parse_rank_label("<b style='color:#d62728'>▶ rank 12</b>") == 12
    assert clicks.parse_rank_label("rank 3 (slow)") == 3
    assert clicks.parse_rank_label("p50") is None
    assert clicks.parse_rank_label(4) is None


def test_the_fault_that_caused_an_incident() -> None:
    inc = js.incident(3, rank=1, detected_s=100)
    right = js.fault(1, rank=1, fired_s=80)
    other_rank = js.fault(2, rank=0, fired_s=90)
    after = js.fault(3, rank=1, fired_s=110)
    pending = js.fault(4, rank=1, fired_s=None, status=FaultStatus.PENDING)
    too_old = js.fault(5, rank=1, fired_s=100 - 3600)
    assert joins.cause_fault(inc, [right, other_rank, after, pending, too_old]) == right
    node_fault = js.fault(6, FaultKind.KILL_NODE, rank=None, node_id="node-2", fired_s=95)
    assert joins.cause_fault(inc, [right, node_fault]) == node_fault  # the newest that matches
    assert joins.cause_fault(inc, [js.fault(7, rank=None, node_id="node-9", fired_s=95)]) is None

    phases = joins.incident_phases(inc, right)
    assert list(phases) == ["fault", "detected", "acted", "recovered"]
    assert phases["detected"] - phases["fault"] == timedelta(seconds=20)
    open_one = js.incident(4, acted_s=None, recovered_s=None)
    assert list(joins.incident_phases(open_one, None)) == ["detected"]


def _invalid_event(event_id: int, path: str, reason: str, seconds: float) -> EventPublic:
    return EventPublic(id=event_id, ts=js.T0 + timedelta(seconds=seconds), kind="checkpoint_invalid", job_id="job",
                       node_id=None, message=f"checkpoint found invalid: {reason}",
                       data={"step": 0, "path": path, "reason": reason})


def test_which_checkpoint_each_restart_restored() -> None:
    c20, c40, c60 = js.checkpoint(1, 20), js.checkpoint(2, 40, valid=False), js.checkpoint(3, 60)
    # Checkpoint 40 was found corrupt at the first restart (t=50): that restart went back to 20; the
    # second restart (t=70, step 65) restored 60.
    events = [_invalid_event(9, "/ckpt/step-40", "sha256 mismatch in model.pt", 50)]
    first = js.marker("restart", 45, ts=js.TS0 + 50)
    second = js.marker("restart", 65, ts=js.TS0 + 70)
    pairs = joins.restores([second, first], [c20, c40, c60], events)
    assert [(m.step, c.step if c else None) for m, c in pairs] == [(45, 20), (65, 60)]
    # Corrupted only after a restart: that restart had restored it.
    late = [_invalid_event(9, "/ckpt/step-40", "overwritten", 200)]
    assert joins.restored_checkpoint(first, [c20, c40], joins.invalid_times(late)) == c40
    # A restart marker's ref is the incident it ended, not a checkpoint.
    assert joins.restored_checkpoint(js.marker("restart", 65, ref="1", ts=js.TS0 + 70), [c20, c60]) == c60
    assert joins.restored_checkpoint(js.marker("restart", 5), [c20]) is None
    assert joins.invalid_reasons(events) == {"/ckpt/step-40": "sha256 mismatch in model.pt"}
