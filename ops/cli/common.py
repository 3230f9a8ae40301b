"""What every ``vigil`` command that talks to the controller shares: its token, its client, and one
way of saying that a request was refused before it was sent."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from vigil.contract.client import VigilClient
from vigil.contract.settings import admin_token_path, get_settings


def cli_token() -> str | None:
    """The CLI's bearer token: ``VIGIL_TOKEN``, else the admin token ``vigil up`` wrote to <home>/admin-token."""
    from controller.auth import read_token_file

    settings = get_settings()
    return settings.token or read_token_file(admin_token_path(settings.home))


def client_for(args: argparse.Namespace) -> VigilClient:
    """A client of ``--controller`` (default: ``VIGIL_CONTROLLER_URL``) with :func:`cli_token`."""
    return VigilClient(args.controller or get_settings().controller_url, token=cli_token())


def invalid_request(command: str, exc: ValidationError) -> str:
    """A request the wire schema refuses, one ``field: rule`` line per error (the API would answer 422)."""
    lines = [f"{'.'.join(map(str, e['loc'])) or '<request>'}: {e['msg']}" for e in exc.errors()]
    return f"{command}: invalid request\n  " + "\n  ".join(lines)
