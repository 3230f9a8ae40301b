"""Package boundaries of DESIGN.md, the whole layering:

    operator tools (controller/cli, localcluster, processes, agentkeeper, netns, controller/bench,
    vigil/bench): may compose anything
    server (the rest of controller/)   agent   vigil (the rank runtime and API)   dashboard   examples
    the contract (CONTRACT below): standard library, pydantic, httpx; nothing of the packages above

Agent and dashboard import neither torch nor ray; the server never imports the trainer, the agent or
the dashboard (the dashboard mount in controller/app.py excepted) nor the operator tools; agent,
trainer, dashboard and examples take from controller/ only the contract; the trainer never imports
the examples (they are user code on its API). Checked twice: statically over the sources, and in a
fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "agent": {"torch", "ray", "vigil", "dashboard"},
    "dashboard": {"torch", "ray", "vigil", "agent"},
    "controller": {"vigil", "examples"},
    # The trainer is a library the examples use, never the other way round (no private path).
    "vigil": {"examples", "agent", "dashboard"},
    # Examples are written as a user writes them: the rank API and the contract, nothing internal.
    "examples": {"agent", "dashboard", "ray"},
}
EXEMPT = ("vigil/bench/", "examples/ray_train_unchanged/")
"""Benchmarks are operator tools that compose the packages (they run the examples); the Ray Train example
is code written for Ray Train, which imports ``ray`` as its users do."""


CONTRACT = frozenset({
    "controller.schemas", "controller.client", "controller.settings", "controller.optimizer_params",
    "controller.checkpoint_layout", "controller.probe", "controller.background", "controller.link",
})
"""What every package may import from controller/: wire models, the typed client, settings and the
shared paths, optimizer params, the checkpoint layout, waiting, background loops, link shaping."""
OPERATOR = ("controller/cli/", "controller/localcluster.py", "controller/processes.py", "controller/agentkeeper.py",
            "controller/netns.py", "controller/bench/", "vigil/bench/")
"""Composition roots: they start and wire the packages together."""
DASHBOARD_MOUNT = "controller/app.py"


def _modules(path: Path) -> set[str]:
    """Full names of the modules ``path`` imports (``from controller import netns``: controller.netns)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in {"controller", "agent", "vigil", "dashboard"}:  # from controller import netns
                out |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


def _imports(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _modules(path)}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _sources(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_sources_respect_boundaries(package: str) -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & FORBIDDEN[package])
        for p in (ROOT / package).rglob("*.py")
        if _imports(p) & FORBIDDEN[package] and not str(p.relative_to(ROOT)).startswith(EXEMPT)
    }
    assert offenders == {}, f"{package} imports what it must not: {offenders}"


def _from_controller(path: Path) -> set[str]:
    return {m for m in _modules(path) if m.startswith("controller.") or m == "controller"}


def _in_contract(module: str) -> bool:
    """``controller.schemas`` is a package: its modules are the contract too."""
    return any(module == c or module.startswith(c + ".") for c in CONTRACT)


def _contract_files() -> dict[str, list[Path]]:
    out = {}
    for name in CONTRACT:
        base = ROOT / name.replace(".", "/")
        out[name] = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    return out


def test_packages_take_only_the_contract_from_the_controller() -> None:
    offenders = {
        _rel(p): sorted(bad) for p in _sources("agent", "vigil", "dashboard", "examples")
        if not _rel(p).startswith(OPERATOR) and (bad := {m for m in _from_controller(p) if not _in_contract(m)})
    }
    assert offenders == {}, f"imports of the controller's inside (not the contract): {offenders}"


def test_the_contract_stands_alone() -> None:
    offenders = {}
    for name, paths in _contract_files().items():
        assert paths and all(p.is_file() for p in paths), f"contract module {name} not found"
        for path in paths:
            bad = {m for m in _from_controller(path) if not _in_contract(m)}
            bad |= _imports(path) & {"agent", "vigil", "dashboard", "torch", "ray", "sqlalchemy", "fastapi"}
            if bad:
                offenders[_rel(path)] = sorted(bad)
    assert offenders == {}, f"the contract imports more than itself: {offenders}"


def test_the_server_imports_no_operator_tool_and_no_other_package() -> None:
    operator_modules = {"controller.cli", "controller.localcluster", "controller.processes", "controller.agentkeeper",
                        "controller.netns", "controller.bench"}
    offenders = {}
    for p in _sources("controller"):
        rel = _rel(p)
        if rel.startswith(OPERATOR):
            continue
        bad = {m for m in _modules(p) if m.split(".")[0] in {"agent", "vigil", "examples"}
               or any(m == o or m.startswith(o + ".") for o in operator_modules)}
        if rel != DASHBOARD_MOUNT:
            bad |= {m for m in _modules(p) if m.split(".")[0] == "dashboard"}
        if bad:
            offenders[rel] = sorted(bad)
    assert offenders == {}, f"the server reaches up or sideways: {offenders}"


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        (["agent.main"], ["torch", "ray", "vigil"]),
        (["dashboard.app"], ["torch", "ray", "vigil"]),
        (["controller.app", "controller.cli"], ["vigil"]),
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """What importing ``path`` imports at once (module level; ``if TYPE_CHECKING:`` blocks excluded)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.Try | ast.If):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                out |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return out & known


def test_no_import_cycles() -> None:
    """No module imports, at import time, a module that imports it back (directly or around a circle)."""
    paths = {_module_name(p): p for p in _sources("agent", "controller", "dashboard", "vigil", "examples")}
    graph = {m: _top_level_imports(p, set(paths)) - {m} for m, p in paths.items()}  # a package naming itself
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], f"import cycles: {cycles}"
