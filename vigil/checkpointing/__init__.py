"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): a manifest, validity, fallback, retention, resharding.

The package, by concern:

* :mod:`~controller.checkpoint_layout` (shared with the agent): the ``step-XXXXXXXX`` folder names and the manifest's file
  name (torch-free);
* :mod:`~vigil.checkpointing.storage`: where checkpoints are stored, a local folder or a URI
  (``s3://bucket/prefix``), through fsspec;
* :mod:`~vigil.checkpointing.format`: the stored format (manifest, checksums, validity, pointers),
  where a job's checkpoints live, retention and the choice of the newest valid checkpoint;
* :mod:`~vigil.checkpointing.state`: the named state of a rank (``state_of``, ``check_state``), its
  layout (replicated, local, sharded) and its flattening to DCP keys;
* :mod:`~vigil.checkpointing.reshard`: save and restore one folder, restoring on any world size;
* :mod:`~vigil.checkpointing.checkpointer`: the train loop's :class:`Checkpointer` (async saves,
  agreement across ranks on finite state, fallback past invalid checkpoints, reports).

This module re-exports what the rest of Vigil uses.
"""

from controller.checkpoint_layout import MANIFEST_FILE, Location, as_location, step_dir
from vigil.checkpointing.checkpointer import Checkpointer
from vigil.checkpointing.format import (
    POINTER_FILE,
    InvalidCheckpoint,
    choose,
    job_root,
    list_step_dirs,
    prune,
    resolve,
    verify,
    write_pointer,
)
from vigil.checkpointing.reshard import restore, save
from vigil.checkpointing.state import state_of

__all__ = [
    "MANIFEST_FILE",
    "POINTER_FILE",
    "Checkpointer",
    "InvalidCheckpoint",
    "Location",
    "as_location",
    "choose",
    "job_root",
    "list_step_dirs",
    "prune",
    "resolve",
    "restore",
    "save",
    "state_of",
    "step_dir",
    "verify",
    "write_pointer",
]
