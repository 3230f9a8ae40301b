"""The HTTP side of commands: the :class:`CommandTransport` seam the runner polls and answers
through, and :class:`ClientCommandTransport`, the real one on :class:`~vigil.contract.client.VigilClient`,
which polls and answers through whichever of the agent's controllers is up (:mod:`agent.failover`;
an answer made again on another controller is idempotent there).
"""

from __future__ import annotations

from typing import Protocol

from agent.failover import FailoverClient
from vigil.contract.client import VigilClient
from vigil.contract.schemas import CommandResult, NodeCommand


class CommandTransport(Protocol):
    """Fetches this node's pending commands and posts answers; raises on failure."""

    def fetch(self) -> list[NodeCommand]: ...

    def post_result(self, command_id: int, result: CommandResult) -> None: ...


class ClientCommandTransport:
    """The real transport: :meth:`VigilClient.node_commands` / :meth:`VigilClient.post_command_result`
    on the controller that answers (a single client is one controller)."""

    def __init__(self, client: VigilClient | FailoverClient, node_id: str, wait_s: float = 0.0) -> None:
        self.client = client if isinstance(client, FailoverClient) else FailoverClient([client], [""])
        self.node_id = node_id
        self.wait_s = wait_s
        """A long poll: the controller answers as soon as a command is queued, or after this long."""

    def fetch(self) -> list[NodeCommand]:
        return list(self.client.call(lambda c: c.node_commands(self.node_id, status="PENDING", wait_s=self.wait_s)).data)

    def post_result(self, command_id: int, result: CommandResult) -> None:
        self.client.call(lambda c: c.post_command_result(self.node_id, command_id, result))
