"""Actions from the dashboard: cancel, recover or inject a fault into a job; evict or readmit a node.

Two panels, each a component a page places in its layout (once per page), with their callbacks:

* :func:`job_actions_panel` (ids ``actions-job-*``): "Cancel job", "Recover" (reason, and a node to
  evict first: :class:`~vigil.contract.schemas.RecoverRequest`) and "Inject fault"
  (:class:`~vigil.contract.schemas.FaultCreate`: kind, rank or node, step, params);
* :func:`node_actions_panel` (ids ``actions-node-*``): "Evict" (with the ranks' deadline) and "Readmit".

Every action asks for confirmation in a modal first, and runs only for a browser signed in with a
``user`` or ``admin`` token (:func:`dashboard.auth.may_act`). For the read-only default (the app's
own token) or a viewer, the button shows a refusal and nothing is sent to the controller; if the
controller refuses anyway (403, 409...), its answer is shown. The outcome goes to
``actions-job-result`` / ``actions-node-result``.

The panels' callbacks are registered on each app by :func:`register_callbacks` (called by
:func:`dashboard.app.create_dash_app`, as each page's ``register``). Place a panel in a part of the page that the page's
polling callback does not re-render, or an open dialog would be reset under the user.
"""

from __future__ import annotations

import json
from typing import Any

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, State, dcc, html
from pydantic import ValidationError

from dashboard import auth
from dashboard.context import FETCH_ERRORS, describe_error, open_client
from vigil.contract.client import ApiError
from vigil.contract.schemas import FaultCreate, FaultKind, RecoverRequest

HIDDEN = {"display": "none"}
SHOWN = {"display": "block"}
DEFAULT_EVICT_DEADLINE_S = 5.0
RANK_FAULTS = frozenset({FaultKind.KILL_RANK, FaultKind.HANG_RANK, FaultKind.SLOW_RANK, FaultKind.NAN_LOSS})

JOB_ACTIONS: dict[str, tuple[str, str]] = {
    "cancel": ("Cancel job", "cancel a job"),
    "recover": ("Recover job", "recover a job"),
    "fault": ("Inject a fault", "inject a fault"),
}
"""action -> (dialog title, what it does, for a refusal)."""
NODE_ACTIONS: dict[str, tuple[str, str]] = {
    "evict": ("Evict node", "evict a node"),
    "readmit": ("Readmit node", "readmit a node"),
}


# --------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------


def _field(label: str, control: Any, help_text: str | None = None) -> html.Div:
    parts = [dbc.Label(label, html_for=control.id, className="mb-0 small"), control]
    if help_text:
        parts.append(dbc.FormText(help_text))
    return html.Div(parts, className="mb-2")


def _modal(prefix: str, body: list[Any]) -> dbc.Modal:
    return dbc.Modal(
        [
            dbc.ModalHeader(dbc.ModalTitle(id=f"{prefix}-modal-title"), close_button=False),
            dbc.ModalBody([html.P(id=f"{prefix}-modal-text"), *body]),
            dbc.ModalFooter([
                dbc.Button("Confirm", id=f"{prefix}-confirm", color="danger", n_clicks=0),
                dbc.Button("Dismiss", id=f"{prefix}-dismiss", color="secondary", n_clicks=0),
            ]),
        ],
        id=f"{prefix}-modal",
        is_open=False,
        backdrop="static",
    )


def job_actions_panel(job_id: str | None) -> html.Div:
    """Buttons acting on ``job_id`` (cancel, recover, inject fault), their confirmation dialog and
    the outcome line ``actions-job-result``. Ids start with ``actions-job-``."""
    kinds = [{"label": k.value, "value": k.value} for k in FaultKind]
    recover_form = html.Div(
        [
            _field("Reason", dbc.Input(id="actions-job-recover-reason", value="manual (dashboard)", maxLength=1024)),
            _field("Evict this node first (optional)", dbc.Input(id="actions-job-recover-evict", placeholder="node id")),
        ],
        id="actions-job-recover-form",
        style=HIDDEN,
    )
    fault_form = html.Div(
        [
            _field("Kind", dbc.Select(id="actions-job-fault-kind", options=kinds, value=FaultKind.SLOW_RANK.value)),
            _field("Rank", dbc.Input(id="actions-job-fault-rank", type="number", min=0, step=1),
                   "rank faults: kill_rank, hang_rank, slow_rank, nan_loss"),
            _field("Node", dbc.Input(id="actions-job-fault-node", placeholder="node id"),
                   "node faults (kill_node, NIC faults, partition_node)"),
            _field("At step", dbc.Input(id="actions-job-fault-step", type="number", min=0, step=1, value=0),
                   "fires once the job reaches this step (0: at once)"),
            _field("Params (JSON object)", dbc.Input(id="actions-job-fault-params", value="{}"),
                   'kind-specific, e.g. {"factor": 3} for slow_rank'),
        ],
        id="actions-job-fault-form",
        style=HIDDEN,
    )
    return html.Div(
        [
            dcc.Store(id="actions-job-id", data=job_id),
            dcc.Store(id="actions-job-pending", data=None),
            dbc.ButtonGroup(
                [
                    dbc.Button("Cancel job", id="actions-job-cancel", color="danger", outline=True, size="sm",
                               n_clicks=0),
                    dbc.Button("Recover", id="actions-job-recover", color="warning", outline=True, size="sm",
                               n_clicks=0),
                    dbc.Button("Inject fault", id="actions-job-fault", color="secondary", outline=True, size="sm",
                               n_clicks=0),
                ],
                className="me-2",
            ),
            _modal("actions-job", [recover_form, fault_form]),
            html.Div(id="actions-job-result", className="mt-2"),
        ],
        id="actions-job-panel",
        className="my-2",
    )


def node_actions_panel(node_id: str | None) -> html.Div:
    """Buttons acting on ``node_id`` (evict, readmit), their confirmation dialog and the outcome line
    ``actions-node-result``. Ids start with ``actions-node-``."""
    evict_form = html.Div(
        _field("Deadline for the node's ranks to checkpoint (s)",
               dbc.Input(id="actions-node-deadline", type="number", min=0.1, max=3600, value=DEFAULT_EVICT_DEADLINE_S)),
        id="actions-node-evict-form",
        style=HIDDEN,
    )
    return html.Div(
        [
            dcc.Store(id="actions-node-id", data=node_id),
            dcc.Store(id="actions-node-pending", data=None),
            dbc.ButtonGroup([
                dbc.Button("Evict", id="actions-node-evict", color="danger", outline=True, size="sm", n_clicks=0),
                dbc.Button("Readmit", id="actions-node-readmit", color="success", outline=True, size="sm",
                           n_clicks=0),
            ]),
            _modal("actions-node", [evict_form]),
            html.Div(id="actions-node-result", className="mt-2"),
        ],
        id="actions-node-panel",
        className="my-2",
    )


# --------------------------------------------------------------------------------------------------
# What each action does (pure where it can be)
# --------------------------------------------------------------------------------------------------


def result_message(text: str, ok: bool, prefix: str) -> dbc.Alert:
    """The outcome of an action (or its refusal), with the id ``{prefix}-result-text``."""
    return dbc.Alert(text, id=f"{prefix}-result-text", color="success" if ok else "danger", className="py-1 px-2 mb-0",
                     dismissable=False)


def parse_fault(kind: str | None, rank: Any, node: str | None, step: Any, params: str | None) -> FaultCreate:
    """The fault the form describes; ``ValueError`` (a pydantic ValidationError is one) or ``TypeError``
    saying what is wrong."""
    try:
        parsed = json.loads(params or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"params: not JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise TypeError("params: a JSON object is expected, e.g. {\"factor\": 3}")
    return FaultCreate.model_validate({
        "kind": kind,
        "rank": None if rank in (None, "") else int(rank),
        "node_id": (node or "").strip() or None,
        "step": 0 if step in (None, "") else int(step),
        "params": parsed,
    })


def _validation_text(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'fault'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def describe_action_error(exc: Exception) -> str:
    """What to tell the person when the controller did not carry an action out."""
    if isinstance(exc, ApiError) and exc.status_code == 403:
        return f"Refused by the controller: {exc.detail}"
    if isinstance(exc, ApiError) and exc.status_code == 401:
        return f"Refused by the controller: {exc.detail} (signed out; sign in again)"
    return f"Failed: {describe_error(exc)}"


def _run(call: Any) -> tuple[str, bool]:
    """Run ``call(client)`` with the session's client: (message, ok)."""
    try:
        with open_client() as client:
            return call(client), True
    except FETCH_ERRORS as exc:
        return describe_action_error(exc), False


def run_job_action(action: str, job_id: str, form: dict[str, Any]) -> tuple[str, bool]:
    """Carry out a confirmed job action for the signed-in session: (message, ok)."""
    if action == "cancel":
        return _run(lambda c: f"Cancelled: job {job_id} is {c.cancel_job(job_id).status.value}.")
    if action == "recover":
        try:
            req = RecoverRequest(reason=form.get("reason") or "manual (dashboard)",
                                 evict_node=(form.get("evict") or "").strip() or None)
        except ValidationError as exc:
            return f"Not sent: {_validation_text(exc)}", False
        return _run(lambda c: f"Recovery started: incident {c.recover_job(job_id, req).id} "
                              f"({'evicting ' + req.evict_node + ', ' if req.evict_node else ''}restart from the "
                              "newest valid checkpoint).")
    if action == "fault":
        try:
            spec = parse_fault(form.get("kind"), form.get("rank"), form.get("node"), form.get("step"),
                               form.get("params"))
        except (ValueError, TypeError) as exc:
            return f"Not sent: {_validation_text(exc) if isinstance(exc, ValueError) else exc}", False

        def inject(c: Any) -> str:
            f = c.inject_fault(job_id, spec)
            target = f"rank {f.rank}" if f.rank is not None else f"node {f.node_id}"
            return f"Fault {f.id} ({f.kind.value} on {target} at step {f.step}) is {f.status.value}."

        return _run(inject)
    return f"Unknown action {action!r}", False


def run_node_action(action: str, node_id: str, deadline_s: Any) -> tuple[str, bool]:
    """Carry out a confirmed node action for the signed-in session: (message, ok)."""
    if action == "evict":
        try:
            deadline = float(deadline_s) if deadline_s not in (None, "") else DEFAULT_EVICT_DEADLINE_S
        except (TypeError, ValueError):
            return "Not sent: the deadline must be a number of seconds", False
        if not 0 < deadline <= 3600:
            return "Not sent: the deadline must be above 0 and at most 3600 s", False

        def evict(c: Any) -> str:
            r = c.evict_node(node_id, deadline_s=deadline)
            return f"Evicted: node {r.node_id} is {r.state.value}" + (f" ({r.outcome})." if r.outcome else ".")

        return _run(evict)
    if action == "readmit":
        return _run(lambda c: f"Readmitted: node {node_id} is {c.readmit_node(node_id).state.value}.")
    return f"Unknown action {action!r}", False


def _job_prompt(action: str, job_id: str) -> str:
    return {
        "cancel": f"Cancel job {job_id}? Its ranks are stopped; this cannot be undone.",
        "recover": f"Restart every rank of job {job_id} from its newest valid checkpoint?",
        "fault": f"Inject this fault into job {job_id}? It is carried out for real once the job reaches the step.",
    }[action]


def _node_prompt(action: str, node_id: str) -> str:
    return {
        "evict": f"Evict node {node_id}? Its ranks checkpoint and restart elsewhere; it stays out until readmitted.",
        "readmit": f"Readmit node {node_id}? Its agent starts a fresh raylet.",
    }[action]


# --------------------------------------------------------------------------------------------------
# Callbacks
# --------------------------------------------------------------------------------------------------


def _extend_validation_layout(app: dash.Dash) -> None:
    """Make the panels part of ``app``'s validation layout, whichever pages place them.

    Dash's renderer checks every callback's ids against the validation layout (the pages' layouts
    and the shell, built by Dash on the first request), and logs "ID not found in layout" in the
    browser's console for a panel that no page's skeleton holds. This runs after Dash built it (a
    later ``before_request`` hook) and adds the panels that are not already there, once.
    """
    panels = (("actions-job-panel", job_actions_panel), ("actions-node-panel", node_actions_panel))
    done = False

    def extend() -> None:
        nonlocal done
        if done or app.validation_layout is None:
            return
        done = True
        extra = [build(None) for pid, build in panels if pid not in app.validation_layout]
        if extra:
            app.validation_layout = html.Div([app.validation_layout, *extra])

    app.server.before_request(extend)


def register_callbacks(app: dash.Dash) -> None:
    """Register both panels' callbacks on ``app`` (and the panels in its validation layout)."""
    _extend_validation_layout(app)
    _register_job_callbacks(app)
    _register_node_callbacks(app)


def _register_job_callbacks(app: dash.Dash) -> None:
    """The job panel's callbacks: open the confirmation dialog (or refuse), then run or dismiss."""

    @app.callback(
        Output("actions-job-modal", "is_open"),
        Output("actions-job-pending", "data"),
        Output("actions-job-modal-title", "children"),
        Output("actions-job-modal-text", "children"),
        Output("actions-job-recover-form", "style"),
        Output("actions-job-fault-form", "style"),
        Output("actions-job-result", "children"),
        Input("actions-job-cancel", "n_clicks"),
        Input("actions-job-recover", "n_clicks"),
        Input("actions-job-fault", "n_clicks"),
        State("actions-job-id", "data"),
        prevent_initial_call=True,
    )
    def ask_job_action(_c: int, _r: int, _f: int, job_id: str | None) -> tuple[Any, ...]:
        trigger = dash.ctx.triggered_id
        action = {"actions-job-cancel": "cancel", "actions-job-recover": "recover",
                  "actions-job-fault": "fault"}.get(str(trigger))
        keep = dash.no_update
        if action is None or not job_id or not dash.ctx.triggered[0].get("value"):
            return (keep,) * 7
        identity = auth.current_identity()
        if not auth.may_act(identity):
            refusal = result_message(auth.refusal(JOB_ACTIONS[action][1], identity), False, "actions-job")
            return False, None, keep, keep, keep, keep, refusal
        return (True, {"action": action}, JOB_ACTIONS[action][0], _job_prompt(action, job_id),
                SHOWN if action == "recover" else HIDDEN, SHOWN if action == "fault" else HIDDEN, None)

    @app.callback(
        Output("actions-job-modal", "is_open", allow_duplicate=True),
        Output("actions-job-pending", "data", allow_duplicate=True),
        Output("actions-job-result", "children", allow_duplicate=True),
        Input("actions-job-confirm", "n_clicks"),
        Input("actions-job-dismiss", "n_clicks"),
        State("actions-job-pending", "data"),
        State("actions-job-id", "data"),
        State("actions-job-recover-reason", "value"),
        State("actions-job-recover-evict", "value"),
        State("actions-job-fault-kind", "value"),
        State("actions-job-fault-rank", "value"),
        State("actions-job-fault-node", "value"),
        State("actions-job-fault-step", "value"),
        State("actions-job-fault-params", "value"),
        prevent_initial_call=True,
    )
    def confirm_job_action(
        _confirm: int, _dismiss: int, pending: dict[str, Any] | None, job_id: str | None, reason: str | None,
        evict: str | None, kind: str | None, rank: Any, node: str | None, step: Any, params: str | None,
    ) -> tuple[Any, ...]:
        if dash.ctx.triggered_id != "actions-job-confirm" or not pending or not job_id:
            return False, None, dash.no_update
        action = str(pending.get("action"))
        identity = auth.current_identity()  # again: the session may have ended while the dialog was open
        if action not in JOB_ACTIONS:
            return False, None, result_message(f"Unknown action {action!r}", False, "actions-job")
        if not auth.may_act(identity):
            return False, None, result_message(auth.refusal(JOB_ACTIONS[action][1], identity), False, "actions-job")
        form = {"reason": reason, "evict": evict, "kind": kind, "rank": rank, "node": node, "step": step,
                "params": params}
        text, ok = run_job_action(action, job_id, form)
        return False, None, result_message(text, ok, "actions-job")


def _register_node_callbacks(app: dash.Dash) -> None:
    """The node panel's callbacks: open the confirmation dialog (or refuse), then run or dismiss."""

    @app.callback(
        Output("actions-node-modal", "is_open"),
        Output("actions-node-pending", "data"),
        Output("actions-node-modal-title", "children"),
        Output("actions-node-modal-text", "children"),
        Output("actions-node-evict-form", "style"),
        Output("actions-node-result", "children"),
        Input("actions-node-evict", "n_clicks"),
        Input("actions-node-readmit", "n_clicks"),
        State("actions-node-id", "data"),
        prevent_initial_call=True,
    )
    def ask_node_action(_e: int, _r: int, node_id: str | None) -> tuple[Any, ...]:
        action = {"actions-node-evict": "evict", "actions-node-readmit": "readmit"}.get(str(dash.ctx.triggered_id))
        keep = dash.no_update
        if action is None or not node_id or not dash.ctx.triggered[0].get("value"):
            return (keep,) * 6
        identity = auth.current_identity()
        if not auth.may_act(identity):
            refusal = result_message(auth.refusal(NODE_ACTIONS[action][1], identity), False, "actions-node")
            return False, None, keep, keep, keep, refusal
        return (True, {"action": action}, NODE_ACTIONS[action][0], _node_prompt(action, node_id),
                SHOWN if action == "evict" else HIDDEN, None)

    @app.callback(
        Output("actions-node-modal", "is_open", allow_duplicate=True),
        Output("actions-node-pending", "data", allow_duplicate=True),
        Output("actions-node-result", "children", allow_duplicate=True),
        Input("actions-node-confirm", "n_clicks"),
        Input("actions-node-dismiss", "n_clicks"),
        State("actions-node-pending", "data"),
        State("actions-node-id", "data"),
        State("actions-node-deadline", "value"),
        prevent_initial_call=True,
    )
    def confirm_node_action(
        _confirm: int, _dismiss: int, pending: dict[str, Any] | None, node_id: str | None, deadline: Any
    ) -> tuple[Any, ...]:
        if dash.ctx.triggered_id != "actions-node-confirm" or not pending or not node_id:
            return False, None, dash.no_update
        action = str(pending.get("action"))
        identity = auth.current_identity()
        if action not in NODE_ACTIONS:
            return False, None, result_message(f"Unknown action {action!r}", False, "actions-node")
        if not auth.may_act(identity):
            return False, None, result_message(auth.refusal(NODE_ACTIONS[action][1], identity), False, "actions-node")
        text, ok = run_node_action(action, node_id, deadline)
        return False, None, result_message(text, ok, "actions-node")
