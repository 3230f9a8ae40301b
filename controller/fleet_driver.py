"""The fleet's Ray driver: a child process of the controller that creates the per-node agent actors.

The controller never connects to Ray as a driver itself (a driver dies with a GCS that stays away, and
the controller must outlive its Ray cluster); :class:`controller.fleet.AgentFleet` starts this process
(``python -m controller.fleet_driver <gcs address>``) and speaks to it in JSON lines on its stdin and
stdout, one answer per request:

- ``{"op": "scan"}`` -> ``{"nodes": [{"ray_id", "name", "alive", "agent"}]}`` where ``agent`` is the
  actor's :meth:`~controller.agent_host.AgentHost.status`, ``"starting"`` (it exists but does not answer
  yet: Ray is starting or restarting it) or None (no actor);
- ``{"op": "deploy", "ray_id", "name", "args", "env"}`` -> ``{"ok": bool, "error": str}``: a detached
  :class:`~controller.agent_host.AgentHost` actor named ``vigil-agent-<name>`` in namespace ``vigil``,
  zero CPUs, pinned to the node (hard affinity), restarted by Ray without end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from controller.agent_host import AgentHost
from controller.launcher import ray_client_env

NAMESPACE = "vigil"
ANSWER_PREFIX = "vigil-fleet "
"""Starts every answer line (the controller skips any other line)."""
STATUS_TIMEOUT_S = 5.0


def actor_name(node: str) -> str:
    return f"vigil-agent-{node}"


def _scan(ray: Any) -> dict[str, Any]:
    out = []
    for n in ray.nodes():
        name = str(n.get("NodeName") or n["NodeID"])
        entry: dict[str, Any] = {"ray_id": n["NodeID"], "name": name, "alive": bool(n.get("Alive")), "agent": None}
        if entry["alive"]:
            try:
                actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
            except ValueError:
                actor = None
            if actor is not None:
                try:
                    entry["agent"] = ray.get(actor.status.remote(), timeout=STATUS_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - starting, restarting, or its node going away
                    entry["agent"] = "starting"
        out.append(entry)
    return {"nodes": out}


def _deploy(ray: Any, req: dict[str, Any]) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    host = ray.remote(AgentHost).options(
        name=actor_name(req["name"]), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(req["ray_id"], soft=False),
    )
    host.remote(list(req["args"]), dict(req["env"]))
    return {"ok": True, "error": ""}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    # Answers on a copy of stdout; whatever Ray (or anything) prints to fd 1 goes to stderr instead, so the
    # controller reads nothing but answers.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING)
    ray_client_env()
    import ray

    ray.init(address=args[0], namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
             include_dashboard=False)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = _scan(ray) if req.get("op") == "scan" else _deploy(ray, req)
        except Exception as exc:  # noqa: BLE001 - every request gets an answer naming its failure
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answers.write(ANSWER_PREFIX + json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
