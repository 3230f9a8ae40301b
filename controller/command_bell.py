"""An agent's poll for commands answered the moment one is queued for its node (a long poll).

The agent asks ``GET /nodes/{node}/commands?wait_s=W``: when nothing is pending the controller holds the
request up to ``W`` seconds and answers as soon as a command for that node is committed. Until this, a
command waited for the agent's next poll (once a heartbeat interval, 1 s: half a second on average, on
each hop of a recovery: the fault, the stacks, the kill).

:data:`BELL` is rung after the commit of a session that queued commands (:func:`queued`: the nodes are
kept until then, :func:`controller.db.on_commit`; a session rolled back rings nothing). A waiting request looks at the
bell every :data:`LOOK_S` (in memory, on the event loop: no thread, no database connection held) and at
the database every :data:`RECHECK_S` too, for commands queued by another process (a standby controller
taking over) which this bell does not hear.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from sqlalchemy.orm import Session

from controller.db import on_commit

LOOK_S = 0.02
"""How often a waiting request looks at the bell."""
RECHECK_S = 0.5
"""How often a waiting request reads the database anyway: commands queued by another process (the
leader among `vigil controller --workers` processes, a standby taking over), which this bell does not hear."""
MAX_WAIT_S = 30.0
"""The longest wait a request may ask for."""

class CommandBell:
    """Per node, how many times commands were committed for it (a counter read before the query and
    compared after: no ring between the two is missed). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rung: dict[str, int] = {}

    def count(self, node_id: str) -> int:
        with self._lock:
            return self._rung.get(node_id, 0)

    def ring(self, node_ids: Iterable[str]) -> None:
        with self._lock:
            for node in node_ids:
                self._rung[node] = self._rung.get(node, 0) + 1


BELL = CommandBell()
"""The process's bell: the sessions that queue commands and the requests that wait share one process."""


def queued(session: Session, node_id: str) -> None:
    """``session`` queued a command for ``node_id``: ring for it once the session commits."""
    on_commit(session, ("command-bell", node_id), lambda: BELL.ring([node_id]))
