"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): a manifest, validity, fallback, retention, resharding.

The package, by concern:

* :mod:`~vigil.contract.checkpoint_layout` (shared with the agent): the ``step-XXXXXXXX`` folder names and the manifest's file
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

This module re-exports what the rest of Vigil uses. The names of the format (where checkpoints live, which one
is valid) load with it; those that need torch (:class:`Checkpointer`, ``save``, ``restore``, ``state_of``) on
first use, so a process that only finds or checks checkpoints (the job's driver) never imports torch's
distributed checkpoint stack.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
from vigil.contract.checkpoint_layout import MANIFEST_FILE, Location, as_location, step_dir

if TYPE_CHECKING:
    from vigil.checkpointing.checkpointer import Checkpointer
    from vigil.checkpointing.reshard import restore, save
    from vigil.checkpointing.state import state_of

_TORCH_NAMES = {"Checkpointer": "checkpointer", "restore": "reshard", "save": "reshard", "state_of": "state"}
"""Names that load their module (and torch) on first use: name -> module of this package."""


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

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
