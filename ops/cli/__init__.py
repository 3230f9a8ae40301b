"""The ``vigil`` command line.

The package, by seam (each module holds its commands' handlers and their argparse definitions):

- :mod:`~ops.cli.services` - running Vigil: ``up``, ``controller``, ``agent``, ``dashboard``, ``db``.
- :mod:`~ops.cli.tokens` - ``token create | list | revoke`` and the ``--expires`` parser.
- :mod:`~ops.cli.jobs` - ``submit``, ``jobs``, ``logs``, ``cancel``; the job file reader and
  the progress bar of ``--follow``.
- :mod:`~ops.cli.recovery` - ``recover``, ``evict``, ``readmit``, ``fault``, ``incidents``.
- :mod:`~ops.cli.bench` - ``bench NAME``, each benchmark in its own process.
- :mod:`~ops.cli.common` - the CLI's token and controller client.

Every command talks to the controller through the public methods of
:class:`~vigil.contract.client.VigilClient` only. This module builds the parser, dispatches, and turns
the controller's 401 and 403 into one line each; the names it re-exports are those other modules and
tests import from ``ops.cli``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ops.cli import bench, jobs, recovery, services, tokens
from ops.cli.bench import BENCHMARKS, cmd_bench
from ops.cli.common import cli_token
from ops.cli.jobs import (
    DEMO_JOB,
    cmd_cancel,
    cmd_jobs,
    cmd_logs,
    cmd_submit,
    demo_job_spec,
    follow_job,
    load_job_file,
)
from ops.cli.recovery import cmd_evict, cmd_fault, cmd_faults, cmd_incidents, cmd_readmit, cmd_recover
from ops.cli.services import LOOPBACK_HOSTS, cmd_agent, cmd_controller, cmd_dashboard, cmd_db, cmd_up
from ops.cli.tokens import cmd_token, parse_expiry
from vigil.contract.client import ApiError
from vigil.contract.settings import admin_token_path, get_settings

__all__ = [
    "BENCHMARKS",
    "COMMANDS",
    "DEMO_JOB",
    "LOOPBACK_HOSTS",
    "PASSTHROUGH",
    "build_parser",
    "cli_token",
    "cmd_agent",
    "cmd_bench",
    "cmd_cancel",
    "cmd_controller",
    "cmd_dashboard",
    "cmd_db",
    "cmd_evict",
    "cmd_fault",
    "cmd_faults",
    "cmd_incidents",
    "cmd_jobs",
    "cmd_logs",
    "cmd_readmit",
    "cmd_recover",
    "cmd_submit",
    "cmd_token",
    "cmd_up",
    "demo_job_spec",
    "follow_job",
    "load_job_file",
    "main",
    "parse_expiry",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vigil", description="Observability and fault tolerance for training on Ray.")
    p.add_argument("--controller", help="Controller URL (default: VIGIL_CONTROLLER_URL or http://127.0.0.1:8000).")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    # In this order: it is the order `vigil --help` lists the commands in.
    for module in (services, tokens, jobs, recovery, bench):
        module.add_parsers(sub)
    return p


PASSTHROUGH: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "agent": cmd_agent, "dashboard": cmd_dashboard, "bench": cmd_bench,
}
"""Commands whose unknown arguments are theirs to parse."""
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "controller": cmd_controller, "db": cmd_db, "submit": cmd_submit, "jobs": cmd_jobs, "logs": cmd_logs,
    "cancel": cmd_cancel, "up": cmd_up, "token": cmd_token, "recover": cmd_recover, "evict": cmd_evict,
    "readmit": cmd_readmit, "fault": cmd_fault, "faults": cmd_faults, "incidents": cmd_incidents,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vigil`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        for noisy in ("httpx", "httpcore", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command in PASSTHROUGH:
        return PASSTHROUGH[args.command](args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return COMMANDS[args.command](args)
    except ApiError as exc:
        if exc.status_code == 401:
            print(f"vigil: the controller wants a valid token ({exc.detail}): set VIGIL_TOKEN, or run where "
                  f"{admin_token_path(get_settings().home)} is (vigil up writes it)", file=sys.stderr)
        elif exc.status_code == 403:
            print(f"vigil: this token may not do that ({exc.detail})", file=sys.stderr)
        else:
            raise
        return 1
