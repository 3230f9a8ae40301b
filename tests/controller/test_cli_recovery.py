"""`vigil fault | incidents | recover | evict | readmit` against a live controller over real HTTP.

Needs: uvicorn on 127.0.0.1 (a port the OS picks), SQLite in tmp_path. No Ray: the commands are
queued for agents, which tests/agent and tests/e2e cover.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ops import cli
from tests.auth import bearer, issue_token
from tests.harness import build_app, serve, settings_for
from vigil.contract.settings import get_settings


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    home = tmp_path / "home"
    monkeypatch.setenv("VIGIL_HOME", str(home))
    apps: list[Any] = []

    def make(url: str) -> Any:
        apps.append(build_app(settings_for(home, controller_url=url)))
        return apps[-1]

    server = serve(make)
    monkeypatch.setenv("VIGIL_CONTROLLER_URL", server.url)
    monkeypatch.setenv("VIGIL_TOKEN", issue_token(apps[0], "user"))
    get_settings.cache_clear()
    try:
        yield server.url, apps[0]
    finally:
        server.stop()
        get_settings.cache_clear()


def test_fault_incidents_recover_evict_readmit(live: tuple[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    url, app = live
    admin = bearer(issue_token(app, "admin"))
    # submitted with the CLI's own (user) token: a user acts on the jobs it submitted
    job_id = httpx.post(f"{url}/api/v1/jobs", json={"name": "j", "steps": 50},
                        headers=bearer(os.environ["VIGIL_TOKEN"])).json()["id"]
    app.state.supervisor.step()  # launched (fake)
    with app.state.sessions() as s:  # the engine says it runs
        from controller.jobs import get_job, transition
        from vigil.contract.schemas import JobStatus

        transition(s, get_job(s, job_id), JobStatus.RUNNING)
        s.commit()
    # an agent's heartbeat tells where rank 1 runs
    hb = {"agent_id": "a", "node_id": "vigil-node-1", "seq": 1, "sent_at": 1.0, "samples": [],
          "heartbeat": {"ts": 1.0, "ranks": [{"job_id": job_id, "rank": 1, "pid": 4242}]}}
    assert httpx.post(f"{url}/api/v1/telemetry", json=hb, headers=admin).status_code == 200

    assert cli.main(["fault", job_id, "slow_rank", "--rank", "1", "--param", "factor=2.5"]) == 0
    assert "slow_rank PENDING" in capsys.readouterr().out
    assert cli.main(["fault", job_id, "slow_rank", "--param", "nokey"]) == 2
    capsys.readouterr()
    assert cli.main(["faults", job_id]) == 0  # the step asked for; none hit yet
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[:6] == ["ID", "KIND", "TARGET", "STEP", "HIT", "STATUS"]
    assert listed[1].split()[1:7] == ["slow_rank", "rank", "1", "0", "-", "PENDING"]
    # What the wire schema refuses is refused before it is sent (the API would answer 422): exit 1, naming the field.
    assert cli.main(["fault", job_id, "teleport", "--rank", "1"]) == 1
    assert "kind: Input should be" in capsys.readouterr().err
    assert cli.main(["fault", job_id, "hang_rank"]) == 1
    assert "rank: required for hang_rank" in capsys.readouterr().err
    assert cli.main(["recover", job_id, "--evict", "bad\nname"]) == 1
    assert "evict_node:" in capsys.readouterr().err
    assert cli.main(["fault", "no-such-job", "kill_rank", "--rank", "1"]) == 1  # the API's 404, printed
    assert "HTTP 404" in capsys.readouterr().err

    assert cli.main(["recover", job_id, "--reason", "operator says so"]) == 0
    assert "manual: operator says so" in capsys.readouterr().out
    assert cli.main(["incidents", "--job", job_id]) == 0
    assert "manual" in capsys.readouterr().out

    assert cli.main(["evict", "vigil-node-1", "--deadline", "3"]) == 1  # a user moves no ranks by default
    assert "VIGIL_USER_NODE_ACTIONS" in capsys.readouterr().err
    app.state.settings.user_node_actions = True  # where the operator lets users do it
    assert cli.main(["evict", "vigil-node-1", "--deadline", "3"]) == 0
    assert "vigil-node-1 EVICTED" in capsys.readouterr().out
    assert cli.main(["readmit", "vigil-node-1"]) == 0
    assert cli.main(["readmit", "vigil-node-1"]) == 1  # not evicted any more: 409
    assert cli.main(["evict", "no-such-node"]) == 1
    cmds = httpx.get(f"{url}/api/v1/nodes/vigil-node-1/commands", headers=admin).json()["data"]
    assert [c["kind"] for c in cmds] == ["kill_pid", "stop_raylet", "start_raylet"]


def test_jobs_shows_steps_done_of_total(live: tuple[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Steps are numbered 1..steps: a job whose last step is 50 of 50 shows 50/50 (not 51/50)."""
    import httpx

    from controller.models import Job

    url, app = live
    admin = bearer(issue_token(app, "admin"))
    done = httpx.post(f"{url}/api/v1/jobs", json={"name": "done", "steps": 50}, headers=admin).json()["id"]
    fresh = httpx.post(f"{url}/api/v1/jobs", json={"name": "fresh", "steps": 40}, headers=admin).json()["id"]
    with app.state.sessions() as s:
        s.get(Job, done).last_step = 50
        s.commit()
    capsys.readouterr()
    assert cli.main(["jobs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[done][2] == "50/50"
    assert rows[fresh][2] == "0/40"
