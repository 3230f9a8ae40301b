"""Where checkpoints live on disk: a job's checkpoint root, the ``step-XXXXXXXX`` folders under it and
the manifest's file name. Part of the contract: the trainer writes this layout, the agent (corrupting
the newest checkpoint on request) and the recovery bench find checkpoints by it.

``<storage>/<slug(job id)>/checkpoints/step-00000120`` holds the checkpoint taken after step 120; it
is complete once its :data:`MANIFEST_FILE` exists (:mod:`vigil.checkpointing.format` says what the
manifest holds and how a folder is verified). Standard library and the schemas only.
"""

from __future__ import annotations

import re
from pathlib import Path

from controller.schemas import slugify

MANIFEST_FILE = "manifest.json"
STEP_DIR_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


ATTEMPTS_DIR = "attempts"
"""``<root>/attempts/<n>``: one empty folder per run attempt of the job's ranks (see :func:`attempts_dir`)."""


def attempts_dir(root: Path) -> Path:
    """Where a job's run attempts are claimed: ``<checkpoint root>/attempts``. Every start of the ranks
    (the first, and each restart) makes the next numbered folder there, so the attempt numbers of one
    job increase on its shared storage across every restart and node (vigil.checkpointing)."""
    return Path(root) / ATTEMPTS_DIR


def job_checkpoint_root(storage_path: Path | str, job_id: str) -> Path:
    """The checkpoint root of job ``job_id`` under the storage path: ``<storage>/<slug(job id)>/checkpoints``."""
    return Path(storage_path) / slugify(job_id) / "checkpoints"


def newest_complete(root: Path) -> tuple[int, Path] | None:
    """``(step, folder)`` of the newest complete checkpoint under ``root`` (a ``step-*`` folder, not a
    symbolic link, holding its manifest), else None."""
    done = [(s, p) for s, p in list_step_dirs(root) if not p.is_symlink() and (p / MANIFEST_FILE).is_file()]
    return done[-1] if done else None


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
