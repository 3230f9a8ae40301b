"""Attacks on the root agent's file writes: ``corrupt_files`` (a fault) writes inside a job's checkpoint, a
folder whose contents the job's own code controls.

Finding (issue 23): the agent resolved a path, checked it was inside the storage root, then opened it by
name, so a folder on the way swapped for a symbolic link between the check and the open led the root agent's
write wherever the link pointed. The agent now opens every component relative to the one before without
following links, and checks that the file it opened is the one it checked. Each test failed before the fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.commands import CommandExecutor, ExecutorConfig
from agent.commands.files import open_under
from vigil.contract.schemas import CommandKind


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    s = tmp_path / "storage"
    (s / "job" / "real").mkdir(parents=True)
    (s / "job" / "real" / "weights.bin").write_bytes(b"w" * 4096)
    return s


@pytest.fixture
def executor(tmp_path: Path, storage: Path) -> Iterator[CommandExecutor]:
    ex = CommandExecutor(ExecutorConfig(node_id="n", run_dir=tmp_path / "run", storage_root=storage),
                         rank_pids=dict)
    try:
        yield ex
    finally:
        ex.close()


def test_a_folder_on_the_way_that_is_a_link_is_never_followed(storage: Path, tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"secret" * 100)
    (storage / "job" / "step-9").symlink_to(outside)  # what a job can make of its own checkpoint folder
    with pytest.raises(OSError):  # ELOOP / ENOTDIR: the link is not followed
        open_under(storage.resolve(), storage.resolve() / "job" / "step-9" / "weights.bin")
    fd = open_under(storage.resolve(), storage.resolve() / "job" / "real" / "weights.bin")
    os.close(fd)


def test_a_file_swapped_after_the_check_is_left_alone(executor: CommandExecutor, storage: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check passes on the real file; before the open, the job swaps its folder for a link to a host
    folder holding a file of the same name: the root agent must not write there."""
    outside = tmp_path / "host"
    outside.mkdir()
    victim = outside / "weights.bin"
    victim.write_bytes(b"h" * 4096)
    real = storage / "job" / "real"
    from agent.commands import files

    checked = files.open_under

    def swap_then_open(root: Path, path: Path) -> int:
        os.rename(real, storage / "job" / "moved")
        real.symlink_to(outside)
        return checked(root, path)

    monkeypatch.setattr(files, "open_under", swap_then_open)
    r = executor.run(CommandKind.CORRUPT_FILES, {"path": str(real)})
    assert victim.read_bytes() == b"h" * 4096  # the host's file is untouched
    assert not r.ok and "cannot open" in str(r.output["skipped"]), r
