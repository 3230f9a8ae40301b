"""Package boundaries of DESIGN.md: agent and dashboard import neither torch nor ray; the controller
never imports the trainer; the trainer never imports the examples (they are user code on its API). Checked twice: statically over the sources, and in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "agent": {"torch", "ray", "trainer", "dashboard"},
    "dashboard": {"torch", "ray", "trainer", "agent"},
    "controller": {"trainer", "examples"},
    # The trainer is a library the examples use, never the other way round (no private path).
    "trainer": {"examples", "agent", "dashboard"},
    # Examples are written as a user writes them: the rank API and the contract, nothing internal.
    "examples": {"agent", "dashboard", "ray"},
}
EXEMPT = ("trainer/bench/",)
"""Benchmarks are operator tools that compose the packages (they run the examples)."""


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_sources_respect_boundaries(package: str) -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & FORBIDDEN[package])
        for p in (ROOT / package).rglob("*.py")
        if _imports(p) & FORBIDDEN[package] and not str(p.relative_to(ROOT)).startswith(EXEMPT)
    }
    assert offenders == {}, f"{package} imports what it must not: {offenders}"


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        (["agent.main"], ["torch", "ray", "trainer"]),
        (["dashboard.app"], ["torch", "ray", "trainer"]),
        (["controller.app", "controller.cli"], ["trainer"]),
    ],
)
def test_runtime_imports_respect_boundaries(modules: list[str], forbidden: list[str]) -> None:
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [m for m in {forbidden!r} if m in sys.modules]\nprint(bad)\nsys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, f"importing {modules} pulled in {r.stdout.strip()} {r.stderr[-2000:]}"
