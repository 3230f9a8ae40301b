"""Faults and recovery: ``vigil recover | evict | readmit | fault | incidents``.

Each command is one call of :class:`~vigil.contract.client.VigilClient`; a refusal of the API is
printed and exits 1, and so is a request the wire schema refuses before it is sent.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from pydantic import ValidationError

from ops.cli.common import client_for, invalid_request
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import FaultCreate, RecoverRequest

T = TypeVar("T")


def _call(args: argparse.Namespace, request: Callable[[VigilClient], T]) -> T | None:
    """One REST call for the recovery commands; prints the API's refusal and returns None on error."""
    with client_for(args) as client:
        try:
            return request(client)
        except ApiError as exc:
            print(exc, file=sys.stderr)
            return None


def cmd_recover(args: argparse.Namespace) -> int:
    try:
        body = RecoverRequest(reason=args.reason, evict_node=args.evict or None)
    except ValidationError as exc:
        print(invalid_request("recover", exc), file=sys.stderr)
        return 1
    inc = _call(args, lambda client: client.recover_job(args.job, body))
    if inc is None:
        return 1
    print(f"incident {inc.id}: {inc.action}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    out = _call(args, lambda client: client.evict_node(args.node, deadline_s=args.deadline))
    if out is None:
        return 1
    print(f"{args.node} EVICTED: {out.outcome}")
    return 0


def cmd_readmit(args: argparse.Namespace) -> int:
    if _call(args, lambda client: client.readmit_node(args.node)) is None:
        return 1
    print(f"{args.node} readmitted (its agent starts a fresh raylet)")
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    params: dict[str, object] = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--param: expected KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        try:
            params[key] = float(value) if "." in value else int(value)
        except ValueError:
            params[key] = value
    body: dict[str, object] = {"kind": args.kind, "step": args.step, "params": params}
    if args.rank is not None:
        body["rank"] = args.rank
    if args.node:
        body["node_id"] = args.node
    try:
        spec = FaultCreate.model_validate(body)
    except ValidationError as exc:
        print(invalid_request("fault", exc), file=sys.stderr)
        return 1
    f = _call(args, lambda client: client.inject_fault(args.job, spec))
    if f is None:
        return 1
    print(f"fault {f.id}: {f.kind.value} {f.status.value} (fires at step {f.step})")
    return 0


def cmd_faults(args: argparse.Namespace) -> int:
    out = _call(args, lambda client: client.list_faults(args.job))
    if out is None:
        return 1
    print(f"{'ID':>4} {'KIND':<18} {'TARGET':<16} {'STEP':>6} {'HIT':>6} {'STATUS':<8} MESSAGE")
    for f in out.data:
        target = f"rank {f.rank}" if f.rank is not None else (f.node_id or "-")
        print(f"{f.id:>4} {f.kind.value:<18} {target:<16} {f.step:>6} {'-' if f.hit_step is None else f.hit_step:>6} "
              f"{f.status.value:<8} {f.message or ''}")
    return 0


def cmd_incidents(args: argparse.Namespace) -> int:
    out = _call(args, lambda client: client.list_incidents(job_id=args.job or None))
    if out is None:
        return 1
    print(f"{'ID':>4} {'KIND':<12} {'STATUS':<10} {'JOB':<18} {'NODE':<14} {'RANK':>4}  ACTION")
    for i in out.data:
        print(f"{i.id:>4} {i.kind.value:<12} {i.status.value:<10} {i.job_id or '-':<18} {i.node_id or '-':<14} "
              f"{'-' if i.rank is None else i.rank:>4}  {i.action or ''}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``recover``, ``evict``, ``readmit``, ``fault``, ``faults`` and ``incidents`` on ``sub``."""
    rc = sub.add_parser("recover", help="Restart a job's ranks from its newest valid checkpoint.")
    rc.add_argument("job")
    rc.add_argument("--evict", metavar="NODE", help="Evict this node first.")
    rc.add_argument("--reason", default="manual recovery")

    ev = sub.add_parser("evict", help="Drain a node in Ray; it stays out until readmitted.")
    ev.add_argument("node")
    ev.add_argument("--deadline", type=float, default=5.0, help="Seconds the node's ranks get to checkpoint.")

    ra = sub.add_parser("readmit", help="Take an evicted node back.")
    ra.add_argument("node")

    fa = sub.add_parser("fault", help="Inject a fault into a running job (kill_rank, hang_rank, ...).")
    fa.add_argument("job")
    fa.add_argument("kind")
    fa.add_argument("--rank", type=int)
    fa.add_argument("--node")
    fa.add_argument("--step", type=int, default=0, help="Fire once the job reaches this step.")
    fa.add_argument("--param", action="append", metavar="KEY=VALUE", help="Kind-specific parameter (repeatable).")

    fl = sub.add_parser("faults", help="A job's injected faults: the step asked for and the step each really hit.")
    fl.add_argument("job")

    ic = sub.add_parser("incidents", help="List incidents (of one job with --job).")
    ic.add_argument("--job")
