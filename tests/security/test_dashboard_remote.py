"""Attack on the dashboard's reads: whoever reached the controller's port read every job, node and incident
through the mounted dashboard, which reads the API with a viewer token of its own.

Finding (issue 23): that held when the controller was bound to an address other hosts can reach
(``vigil controller --host 0.0.0.0 --allow-remote``). There the dashboard now holds no token: a browser signs
in (any reading token) before it sees anything: the dashboard's calls carry the signed-in browser's token or
none, and the API answers 401 without one (tests/controller/test_auth.py). On loopback it still opens read-only,
as before. The test failed before the fix (the real controller app and its mounted dashboard)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from ops.cli.services import remote_dashboard
from tests.harness import build_app
from vigil.contract.settings import Settings


def test_bound_for_other_hosts_the_dashboard_reads_nothing_before_sign_in(tmp_path: Path) -> None:
    base = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'v.db'}")
    assert remote_dashboard("127.0.0.1", base) == {}
    remote = base.model_copy(update=remote_dashboard("0.0.0.0", base))
    assert remote.dashboard_open_reads is False
    for settings, tokens in ((base, 1), (remote, 0)):
        app = build_app(settings, dashboard=True)
        with TestClient(app):
            # the dashboard's own viewer token is minted only where its reads are open
            assert len(app.state.internal_tokens) == tokens, settings.dashboard_open_reads
