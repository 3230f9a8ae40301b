"""Fixtures of the agent tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path: unix socket paths are limited to 107 bytes, pytest's tmp_path
    can be longer."""
    d = Path(tempfile.mkdtemp(prefix="vga-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
