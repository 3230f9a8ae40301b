"""Shared fixtures for the trainer tests: one CPU thread per process, one corpus cache per session, an
S3-compatible server (``s3_server``, ``s3``: :mod:`tests.s3server`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.s3server import s3, s3_server  # noqa: F401 - fixtures of this folder


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # The machine is shared; intra-op threads only add contention at these model sizes.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus cache directory shared by the session's tests (built once, read after)."""
    return tmp_path_factory.mktemp("vigil-cache")
