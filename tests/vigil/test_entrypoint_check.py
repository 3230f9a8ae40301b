"""vigil.runner.check_entrypoint: the driver's look at a job's entry point before any rank starts.

A function's module is read, not run (the driver never trains: running it would load the user's imports,
torch among them); a module that binds the name where reading cannot see it is imported after all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vigil.runner import EntrypointError, check_entrypoint, defines


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_function_is_found_by_reading_its_module_which_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, monkeypatch, "ep_read", "raise RuntimeError('ran')\ndef train(config):\n    pass\n")
    entry = check_entrypoint("ep_read:train")
    assert (entry.module, entry.function) == ("ep_read", "train")
    assert "ep_read" not in sys.modules


def test_a_missing_module_or_function_or_script_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EntrypointError, match=r"cannot import 'ep_nowhere' \(no such module\)"):
        check_entrypoint("ep_nowhere:train")
    with pytest.raises(EntrypointError, match="cannot import 'ep_nopkg.mod'"):
        check_entrypoint("ep_nopkg.mod:train")
    _module(tmp_path, monkeypatch, "ep_nofn", "def other(config):\n    pass\n")
    with pytest.raises(EntrypointError, match="'ep_nofn' has no function 'train'"):
        check_entrypoint("ep_nofn:train")
    with pytest.raises(EntrypointError, match="script 'absent.py' not found in the working directory"):
        check_entrypoint("python absent.py --x 1", cwd=tmp_path)


def test_a_module_that_is_not_python_is_refused_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, monkeypatch, "ep_broken", "def train(config:\n")
    with pytest.raises(EntrypointError, match="cannot read ep_broken.py"):
        check_entrypoint("ep_broken:train")


def test_a_name_bound_where_reading_cannot_see_it_is_looked_up_by_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "ep_dynamic", "globals()['train'] = lambda config: None\n")
    assert check_entrypoint("ep_dynamic:train").function == "train"
    assert "ep_dynamic" in sys.modules  # imported to find it
    _module(tmp_path, monkeypatch, "ep_notfn", "globals()['train'] = 3\n")
    with pytest.raises(EntrypointError, match="has no function 'train'"):
        check_entrypoint("ep_notfn:train")


@pytest.mark.parametrize(("source", "found"), [
    ("def train(c): ...", True), ("async def train(c): ...", True), ("class train: ...", True),
    ("train = print", True), ("train: object = print", True), ("from os import path as train", True),
    ("import train", True), ("import train.sub", True), ("train: object", False), ("def training(c): ...", False),
    ("if True:\n    def train(c): ...", False), ("x, train = 1, 2", False),
])
def test_defines_reads_the_top_level_bindings(tmp_path: Path, source: str, found: bool) -> None:
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert defines(path, "train") is found
