"""Agents on every node of a Ray cluster Vigil did not start, deployed through Ray (``VIGIL_DEPLOY_AGENTS``).

The leader controller runs :class:`AgentFleet`: every ``interval`` seconds it asks Ray (through its fleet
driver, :mod:`controller.fleet_driver`, a child process) for the node table and each node's agent actor;
an alive node with no actor gets one (:mod:`controller.agent_host`), with a token of its own scoped to that
node (the ``agent`` role: telemetry and commands of that node only; the previous fleet token of the node
is revoked). A node that joins later gets its agent at the next pass; a node that leaves takes its actor
with it and is forgotten. A dead agent is started again by its actor within a second, a dead actor by Ray.

The agents run as the Ray workers' user (Ray starts the actors), so a job on the node could read the
node's agent token: it lets a job post telemetry and heartbeats as its node, nothing else. Where that is
not acceptable, run ``vigil agent`` as a privileged daemon or sidecar instead (docs/DEPLOY.md).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller.db import session_scope
from controller.fleet_driver import ANSWER_PREFIX
from controller.jobs import record_event
from controller.models import ApiToken
from controller.tokens import create_token, revoke_token
from vigil.contract.background import BackgroundLoop
from vigil.contract.checkpoint_layout import is_uri
from vigil.contract.schemas import Role, TokenCreate
from vigil.contract.settings import ENV_CONTROLLER_URL, ENV_TOKEN, Settings, child_env

log = logging.getLogger(__name__)

FLEET_TOKEN_NAME = "fleet agent of {node}"


class FleetDriver(Protocol):
    def request(self, req: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class SubprocessDriver:
    """:mod:`controller.fleet_driver` as a child process, started on first use and again after it died."""

    def __init__(self, gcs_address: str, timeout_s: float = 60.0) -> None:
        self.gcs_address = gcs_address
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[str] | None = None

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "controller.fleet_driver", self.gcs_address],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env=child_env(), start_new_session=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            while line and not line.startswith(ANSWER_PREFIX):
                log.info("fleet driver: %s", line.rstrip())
                line = self._proc.stdout.readline()
        except OSError as exc:
            self.close()
            raise RuntimeError(f"fleet driver gone: {exc}") from exc
        if not line:
            self.close()
            raise RuntimeError("fleet driver exited (Ray unreachable?)")
        return dict(json.loads(line[len(ANSWER_PREFIX):]))

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None


class AgentFleet(BackgroundLoop):
    """One agent per alive Ray node (module docstring)."""

    thread_name = "vigil-agent-fleet"

    def __init__(self, sessions: sessionmaker[Session], driver: FleetDriver, controller_url: str,
                 agent_args: Callable[[str], list[str]], interval: float = 2.0) -> None:
        self.sessions = sessions
        self.driver = driver
        self.controller_url = controller_url
        self.agent_args = agent_args
        self.interval = interval
        self.deployed: dict[str, int] = {}
        """Actors this controller created, per node name (a count: Ray may have lost one)."""
        super().__init__()

    def tick(self) -> None:
        answer = self.driver.request({"op": "scan"})
        nodes = answer.get("nodes")
        if nodes is None:
            raise RuntimeError(f"the fleet driver could not read Ray's node table: {answer.get('error')}")
        for n in nodes:
            if n["alive"] and n["agent"] is None:
                self._deploy(n["ray_id"], n["name"])

    def _deploy(self, ray_id: str, name: str) -> None:
        with session_scope(self.sessions) as s:
            for old in s.scalars(select(ApiToken).where(ApiToken.role == Role.AGENT.value, ApiToken.node_id == name,
                                                        ApiToken.name == FLEET_TOKEN_NAME.format(node=name),
                                                        ApiToken.revoked_at.is_(None))):
                revoke_token(s, old.id)
            token = create_token(s, TokenCreate(role=Role.AGENT, node_id=name, name=FLEET_TOKEN_NAME.format(node=name)))
        env = {ENV_TOKEN: token.token, ENV_CONTROLLER_URL: self.controller_url}
        answer = self.driver.request({"op": "deploy", "ray_id": ray_id, "name": name,
                                      "args": self.agent_args(name), "env": env})
        with session_scope(self.sessions) as s:
            if answer.get("ok"):
                self.deployed[name] = self.deployed.get(name, 0) + 1
                record_event(s, "agent_deployed", f"agent of {name} deployed through Ray (actor vigil-agent-{name})",
                             node_id=name)
            else:
                revoke_token(s, token.id)
                log.warning("could not deploy the agent of %s: %s", name, answer.get("error"))

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
        self.driver.close()


def agent_fleet(settings: Settings, sessions: sessionmaker[Session]) -> AgentFleet | None:
    """The fleet of ``settings`` (None unless ``deploy_agents``): agents that report to
    ``agent_controller_url`` (else ``controller_url``), with the controller's run folder (where the jobs'
    ranks look for their agent's socket) and, for a local storage, its checkpoint folder."""
    if not settings.deploy_agents:
        return None
    if not settings.ray_gcs_address:
        raise ValueError("deploy_agents: needs ray_gcs_address (VIGIL_RAY_GCS_ADDRESS, --ray-gcs-address)")
    storage = settings.resolved_storage()
    url = settings.agent_controller_url or settings.controller_url

    def args(node: str) -> list[str]:
        out = ["--node-id", node, "--controller", url, "--run-dir", str(settings.run_dir)]
        return out if is_uri(storage) else [*out, "--storage-root", str(storage)]

    return AgentFleet(sessions, SubprocessDriver(settings.ray_gcs_address), url, args)
