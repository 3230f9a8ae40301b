"""Checkpoint folder naming: the ``step-XXXXXXXX`` folders under a root and the manifest's file name.

Torch-free (standard library only), so that whatever has to find checkpoints on disk without the
trainer (the agent, later) can share it. A folder ``<root>/step-00000120`` holds the checkpoint taken
after step 120; it is complete once its :data:`MANIFEST_FILE` exists (see
:mod:`trainer.checkpoint.format` for what the manifest holds and how a folder is verified).
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST_FILE = "manifest.json"
STEP_DIR_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir(root: Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` under ``root``."""
    return Path(root) / f"{STEP_DIR_PREFIX}{step:08d}"


def step_of(directory: Path) -> int | None:
    """The step in a ``step-XXXXXXXX`` folder name, else None."""
    m = _STEP_DIR.match(Path(directory).name)
    return int(m.group(1)) if m else None


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-*`` folder under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return sorted(found)
