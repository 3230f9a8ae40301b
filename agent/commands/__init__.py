"""Commands from the controller, carried out on this node for real (docs/RECOVERY.md).

The controller queues :class:`~vigil.contract.schemas.NodeCommand` s per node; the agent polls
``GET /nodes/{node}/commands?status=PENDING`` once per heartbeat interval (and again at once after
it has done one), carries each one out, in id order, and answers with ``POST .../result``.

Three pieces, each a seam for tests:

- :class:`CommandRunner` - the state machine: ``step()`` polls, runs each new command (at most once
  per agent process: it remembers the ids it has done), posts the results in order and keeps
  unposted ones for the next step. Every command runs in a worker thread with a timeout, so a
  stuck ``py-spy`` or a process in uninterruptible sleep costs that command, not the agent.
- :class:`CommandLoop` - the thread that steps the runner; it never touches the shipper, so
  commands never hold up heartbeats or telemetry.
- :class:`CommandExecutor` - what each kind does. After an agent restart the controller may still
  list a command the previous agent did as PENDING (its answer was lost), so every kind is safe to
  redo: killing a pid that is gone, stopping a raylet that is not running, starting one that runs,
  or corrupting bytes already corrupted all answer ok without doing harm twice.

The controller may only touch processes of this node's training: a pid is acted on only if it is a
rank this agent has received samples from (and the process started before that sample: a reused
pid is refused) or a descendant of this node's raylet; never the agent itself or its ancestors.
``corrupt_files`` only writes under ``storage_root`` (resolved, symlinks refused).

The package, by seam:

- :mod:`~agent.commands.transport` - the HTTP side (:class:`CommandTransport`).
- :mod:`~agent.commands.runner` - :class:`CommandRunner` and :class:`CommandLoop`.
- :mod:`~agent.commands.executor` - :class:`CommandExecutor`: dispatch, timeouts, the pid rule and
  the process kinds; :mod:`~agent.commands.files`, :mod:`~agent.commands.stacks` and
  :mod:`~agent.commands.node` hold the other kinds; :mod:`~agent.commands.config` - what they all know
  of the node (:class:`ExecutorConfig`).
- :mod:`~agent.commands.args` - each kind's argument model; :mod:`~agent.commands.errors` - how a
  failure becomes an answer.
- :mod:`~agent.commands.pids`, :mod:`~agent.commands.raylet`, :mod:`~agent.commands.throttle` -
  processes, finding the raylet, throttling.

This package must never import torch, ray or the trainer.
"""

from agent.commands.config import ExecutorConfig
from agent.commands.executor import CommandExecutor
from agent.commands.files import CORRUPTION
from agent.commands.pids import live_process
from agent.commands.runner import CommandLoop, CommandRunner
from agent.commands.transport import ClientCommandTransport, CommandTransport

__all__ = [
    "CORRUPTION",
    "ClientCommandTransport",
    "CommandExecutor",
    "CommandLoop",
    "CommandRunner",
    "CommandTransport",
    "ExecutorConfig",
    "live_process",
]
