"""API tokens (admin): ``vigil token create | list | revoke``, and the ``--expires`` parser."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime, timedelta

from ops.cli.common import client_for
from vigil.contract.client import ApiError
from vigil.contract.schemas import Role, TokenCreate

_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """``7d``, ``24h``, ``30m``, ``2w``, ``90s`` from now, or an ISO 8601 time (UTC unless it says otherwise)."""
    now = now or datetime.now(UTC)
    m = _DURATION.match(text)
    if m:
        return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--expires: {text!r} is neither a duration (7d, 24h, 30m) nor an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def cmd_token(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        try:
            if args.action == "create":
                expires = parse_expiry(args.expires) if args.expires else None
                spec = TokenCreate(role=Role(args.role), name=args.name or "", job_id=args.job, node_id=args.node,
                                   expires_at=expires)
                tok = client.create_token(spec)
                print(f"created {tok.id} (role {tok.role.value}" + (f", job {tok.job_id}" if tok.job_id else "") +
                      (f", node {tok.node_id}" if tok.node_id else "") +
                      f", expires {tok.expires_at.isoformat() if tok.expires_at else 'never'}); "
                      "it is shown this once, keep it now:")
                print(tok.token)  # alone on the last line, so `| tail -1` captures it
            elif args.action == "list":
                toks = client.list_tokens(limit=args.limit, include_inactive=args.all)
                print(f"{'ID':<21} {'ROLE':<7} {'STATE':<8} {'HINT':<13} {'EXPIRES':<20} {'LAST USED':<20} NAME")
                for t in toks.data:
                    state = "active" if t.active else ("revoked" if t.revoked_at else "expired")
                    exp = t.expires_at.strftime("%Y-%m-%d %H:%M") if t.expires_at else "never"
                    used = t.last_used_at.strftime("%Y-%m-%d %H:%M") if t.last_used_at else "-"
                    name = t.name + (f" [job {t.job_id}]" if t.job_id else "") + (f" [node {t.node_id}]" if t.node_id else "")
                    print(f"{t.id:<21} {t.role.value:<7} {state:<8} {t.hint + '...':<13} {exp:<20} {used:<20} {name}")
            else:
                tok = client.revoke_token(args.token_id)
                print(f"{tok.id} revoked at {tok.revoked_at.isoformat() if tok.revoked_at else '?'}")
        except ApiError as exc:
            print(f"token {args.action}: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # a bad --expires, or a spec the schema refuses
            print(f"token {args.action}: {exc}", file=sys.stderr)
            return 2
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``token create | list | revoke`` on ``sub``."""
    tk = sub.add_parser("token", help="API tokens (admin): create, list, revoke.")
    tks = tk.add_subparsers(dest="action", required=True)
    tc = tks.add_parser("create", help="Issue a token; prints it alone on the last line (shown only once).")
    tc.add_argument("--role", required=True, choices=[r.value for r in Role])
    tc.add_argument("--expires", help="7d, 24h, 30m, or an ISO 8601 time (default: never).")
    tc.add_argument("--name", help="What it is for.")
    tc.add_argument("--job", help="The job a `job` token is scoped to.")
    tc.add_argument("--node", help="The node an `agent` token is scoped to (its agent may act for that node only).")
    tl = tks.add_parser("list", help="List tokens (never their secrets).")
    tl.add_argument("--limit", type=int, default=100)
    tl.add_argument("--active", dest="all", action="store_false", help="Only tokens that still work.")
    tr = tks.add_parser("revoke", help="Revoke a token by id (tok_...).")
    tr.add_argument("token_id")
