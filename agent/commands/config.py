"""What the commands need to know about this node: :class:`ExecutorConfig`.

Its own module so that :mod:`agent.commands.executor` and the kinds mixed into it
(:mod:`agent.commands.files`, :mod:`agent.commands.stacks`, :mod:`agent.commands.node`) all import it
at module level without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ExecutorConfig:
    """What the commands need to know about this node (from :class:`agent.main.AgentConfig`)."""

    #: The node's name as its raylet knows it (``--node-name``) or its Ray node id.
    node_id: str
    #: Node-local runtime folder: fault files go to ``<run_dir>/faults/...``.
    run_dir: Path
    #: ``corrupt_files`` only touches files under this folder (resolved).
    storage_root: Path
    #: Fallbacks when the raylet or ``ray start`` cannot be found by command line.
    raylet_pid: int | None = None
    ray_start_pid: int | None = None
    #: This node's Ray cluster (GCS ``host:port``): only a raylet of that cluster is this node's (two clusters
    #: on one host may name nodes alike). None: any raylet naming the node.
    ray_gcs_address: str | None = None
    #: argv that (re)joins this node to the cluster (``start_raylet``); None: readmission unsupported.
    ray_join_cmd: list[str] | None = None
    #: The ranks' group when they run as another user than the agent: a job's fault folder is theirs to
    #: write (a rank renames its fault file to ``.fired`` before acting on it).
    rank_group: int | None = None
    #: Longest one ``py-spy dump`` may take.
    pyspy_timeout_s: float = 10.0
    #: ``stop_raylet``: seconds between SIGTERM and SIGKILL.
    raylet_stop_grace_s: float = 5.0
    #: ``start_raylet``: how long to wait for the raylet to show up.
    raylet_start_wait_s: float = 60.0
    #: Timeout of every kind without its own.
    default_timeout_s: float = 30.0
    pyspy_workers: int = 4
    #: ``py-spy`` binary; default: next to ``sys.executable`` (the venv), else on PATH.
    pyspy_path: str | None = None
