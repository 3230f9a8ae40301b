"""The CLI's side of authentication: `vigil token create|list|revoke` against a live controller, the
token it sends (VIGIL_TOKEN, else <home>/admin-token), `vigil db create-admin-token`, expiry parsing,
and `vigil controller` refusing a non-loopback address without --allow-remote.

Needs: uvicorn on 127.0.0.1 (a port the OS picks), SQLite in tmp_path. No Ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.auth import ensure_admin_token
from ops import cli
from tests.harness import build_app, serve, settings_for
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import admin_token_path, get_settings


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A clean CLI environment: VIGIL_HOME in tmp_path, no token in the environment."""
    home = tmp_path / "home"
    monkeypatch.setenv("VIGIL_HOME", str(home))
    monkeypatch.setenv("VIGIL_DATABASE_URL", f"sqlite:///{home / 'vigil.db'}")
    for name in ("VIGIL_TOKEN", "VIGIL_AGENT_TOKEN", "VIGIL_AUTH_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield home
    get_settings.cache_clear()


@pytest.fixture
def controller(env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    apps: list[Any] = []

    def make(url: str) -> Any:
        apps.append(build_app(settings_for(env, controller_url=url), launcher=None))
        return apps[-1]

    server = serve(make)
    monkeypatch.setenv("VIGIL_CONTROLLER_URL", server.url)
    get_settings.cache_clear()
    try:
        yield server.url, apps[0]
    finally:
        server.stop()


def test_parse_expiry() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert cli.parse_expiry("7d", now) == now + timedelta(days=7)
    assert cli.parse_expiry("24h", now) == now + timedelta(hours=24)
    assert cli.parse_expiry(" 30m ", now) == now + timedelta(minutes=30)
    assert cli.parse_expiry("2w", now) == now + timedelta(weeks=2)
    assert cli.parse_expiry("2031-02-03T04:05:06", now) == datetime(2031, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert cli.parse_expiry("2031-02-03T04:05:06+02:00", now).utcoffset() == timedelta(hours=2)
    for bad in ("7", "soon", "-1d", "1y"):
        with pytest.raises(ValueError, match="--expires"):
            cli.parse_expiry(bad, now)


def test_cli_token_prefers_env_then_admin_file(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.cli_token() is None
    admin_token_path(env).parent.mkdir(parents=True)
    admin_token_path(env).write_text("vgl_from_file\n")
    assert cli.cli_token() == "vgl_from_file"
    monkeypatch.setenv("VIGIL_TOKEN", "vgl_from_env")
    get_settings.cache_clear()
    assert cli.cli_token() == "vgl_from_env"


def test_token_commands_against_a_live_controller(controller: tuple[str, Any], env: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, app = controller
    # No token anywhere: a clear one-line refusal, not a traceback.
    assert cli.main(["jobs"]) == 1
    assert "VIGIL_TOKEN" in capsys.readouterr().err
    # What `vigil up` leaves behind: the CLI then works without being told anything.
    admin, _ = ensure_admin_token(app.state.sessions, env)
    assert cli.main(["jobs"]) == 0

    capsys.readouterr()
    assert cli.main(["token", "create", "--role", "viewer", "--expires", "1h", "--name", "grafana"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    secret = out[-1]
    assert secret.startswith("vgl_") and " " not in secret  # alone on the last line
    with VigilClient(url, token=secret) as viewer:
        assert viewer.list_jobs().count == 0
        with pytest.raises(ApiError) as denied:
            viewer.submit_job(JobCreate(name="nope"))
        assert denied.value.status_code == 403

    assert cli.main(["token", "list"]) == 0
    listing = capsys.readouterr().out
    (line,) = [ln for ln in listing.splitlines() if "grafana" in ln]
    token_id = line.split()[0]
    assert token_id.startswith("tok_") and "viewer" in line and "active" in line
    assert secret not in listing and secret[:12] in listing  # only a hint of it

    assert cli.main(["token", "revoke", token_id]) == 0
    assert "revoked" in capsys.readouterr().out
    with VigilClient(url, token=secret) as viewer, pytest.raises(ApiError) as gone:
        viewer.list_jobs()
    assert gone.value.status_code == 401
    assert cli.main(["token", "list", "--active"]) == 0
    assert "grafana" not in capsys.readouterr().out

    # Refusals name the problem.
    assert cli.main(["token", "create", "--role", "job"]) == 2
    assert "job_id" in capsys.readouterr().err
    assert cli.main(["token", "create", "--role", "user", "--expires", "whenever"]) == 2
    assert "--expires" in capsys.readouterr().err
    assert cli.main(["token", "revoke", "tok_unknown"]) == 1
    assert "404" in capsys.readouterr().err
    with VigilClient(url, token=admin) as c:
        assert {t.name for t in c.list_tokens().data} == {"admin (bootstrap)", "grafana"}


def test_db_create_admin_token(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["db", "create-admin-token"]) == 0
    path = admin_token_path(env)
    assert "created" in capsys.readouterr().out and path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert cli.main(["db", "create-admin-token"]) == 0
    assert "kept" in capsys.readouterr().out and path.read_text() == first


def test_controller_refuses_remote_bind_without_flag(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import uvicorn

    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    assert cli.main(["controller", "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err and runs == []
    assert cli.main(["controller"]) == 0 and runs[-1]["host"] == "127.0.0.1"  # loopback by default
    monkeypatch.setenv("VIGIL_AUTH_ENABLED", "false")
    get_settings.cache_clear()
    assert cli.main(["controller", "--host", "0.0.0.0", "--allow-remote"]) == 0
    assert runs[-1]["host"] == "0.0.0.0"
    assert "ANYONE" in caplog.text
