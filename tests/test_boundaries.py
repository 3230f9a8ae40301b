"""Package boundaries of DESIGN.md, the whole layering:

    operator tools (ops/: cli, localcluster, processes, agentkeeper, netns, bench; and vigil/bench):
    may compose anything, and nothing imports them
    server (controller/ outside the contract)   agent   vigil (the rank runtime and API)   dashboard   examples
    the contract (CONTRACT below): standard library, pydantic, httpx; nothing of the packages above

Agent and dashboard import neither torch nor ray; the server never imports the trainer, the agent or
the dashboard nor the operator tools (``vigil controller`` mounts the dashboard: ops/); agent,
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
    "agent": {"torch", "ray", "vigil", "dashboard", "ops"},
    "dashboard": {"torch", "ray", "vigil", "agent", "ops"},
    "controller": {"vigil", "examples", "ops", "dashboard", "agent"},
    # The trainer is a library the examples use, never the other way round (no private path).
    "vigil": {"examples", "agent", "dashboard", "ops"},
    "trainer": {"ops"},
    # Examples are written as a user writes them: the rank API and the contract, nothing internal.
    "examples": {"agent", "dashboard", "ray", "ops"},
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
OPERATOR = ("ops/", "vigil/bench/")
"""Composition roots: they start and wire the packages together."""


def _modules(path: Path) -> set[str]:
    """Full names of the modules ``path`` imports (``from ops import netns``: ops.netns)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in {"controller", "agent", "vigil", "dashboard", "ops"}:  # from ops import netns
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
    operator_modules = {"ops"}
    offenders = {}
    for p in _sources("controller"):
        rel = _rel(p)
        if rel.startswith(OPERATOR):
            continue
        bad = {m for m in _modules(p) if m.split(".")[0] in {"agent", "vigil", "examples", "dashboard"}
               or any(m == o or m.startswith(o + ".") for o in operator_modules)}
        if bad:
            offenders[rel] = sorted(bad)
    assert offenders == {}, f"the server reaches up or sideways: {offenders}"


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        (["agent.main"], ["torch", "ray", "vigil"]),
        (["dashboard.app"], ["torch", "ray", "vigil"]),
        (["controller.app"], ["vigil", "ops", "agent", "dashboard", "dash"]),
        (["ops.cli"], ["vigil"]),
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
    paths = {_module_name(p): p for p in _sources("agent", "controller", "dashboard", "vigil", "examples", "ops")}
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


# --------------------------------------------------------------------------------------------------
# Import cycles (deferred imports too), file and function sizes
# --------------------------------------------------------------------------------------------------

CHECKED = ("agent", "controller", "dashboard", "vigil", "trainer", "ops")
"""The first-party packages the cycle and size rules cover (ops/: the operator tools that left controller/)."""
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _checked_files(root: Path, packages: tuple[str, ...] = CHECKED) -> list[Path]:
    """Every ``.py`` file of ``packages`` under ``root``, those in a ``tests`` or ``migrations`` folder excepted."""
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py")
                  if not {"tests", "migrations"} & set(p.relative_to(root).parts))


def _dotted(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known(name: str, known: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a first-party module (``a.b.func``: ``a.b``), None if none."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:n])) in known:
            return prefix
    return None


def _import_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` names: ``from . import x`` in ``a.b.c`` is ``a.b``; absolute as written."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """First-party modules ``path`` imports anywhere in it (in functions and ``TYPE_CHECKING`` blocks too: a
    deferred import hides a circle, it does not break it); ``from pkg import mod`` is ``pkg.mod`` when
    ``mod`` is a module, else ``pkg``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {m for a in node.names if (m := _known(a.name, known))}
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, module, path.name == "__init__.py")
            for a in node.names:
                if (m := _known(f"{base}.{a.name}", known) if a.name != "*" else _known(base, known)):
                    out.add(m)
    return out - {module}


def _import_graph(root: Path, packages: tuple[str, ...] = CHECKED) -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports."""
    paths = {_dotted(p, root): p for p in _checked_files(root, packages)}
    return {m: _imports_of(p, m, set(paths)) for m, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each circle a depth-first walk finds (one per edge back onto its path), as ``a -> b -> a``."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                found.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return found


def _long_files(root: Path, packages: tuple[str, ...] = CHECKED, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path (N lines)`` of each checked file over ``limit`` lines."""
    counts = {p: len(p.read_text().splitlines()) for p in _checked_files(root, packages)}
    return [f"{p.relative_to(root)} ({n} lines)" for p, n in counts.items() if n > limit]


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method in ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                out.append((name, node))
            out += _functions(node, name + ".")
        else:
            out += _functions(node, prefix)
    return out


def _long_functions(root: Path, packages: tuple[str, ...] = CHECKED, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of each function over ``limit`` lines (``def`` to its last line)."""
    out = []
    for path in _checked_files(root, packages):
        for name, fn in _functions(ast.parse(path.read_text(), filename=str(path))):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > limit:
                out.append(f"{path.relative_to(root)}:{fn.lineno} {name} ({n} lines)")
    return out


def test_no_import_cycle_among_first_party_modules_even_deferred() -> None:
    cycles = _cycles(_import_graph(ROOT))
    assert cycles == [], "import cycles (deferred imports counted):\n" + "\n".join(cycles)


def test_no_source_file_over_500_lines() -> None:
    long = _long_files(ROOT)
    assert long == [], f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_80_lines() -> None:
    long = _long_functions(ROOT)
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _fake_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_cycle_check_finds_a_circle_through_a_deferred_relative_import(tmp_path: Path) -> None:
    _fake_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",  # pkg.b, the module
        "pkg/b.py": "def f():\n    from .c import g\n    return g\n",  # in a function, relative
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\ndef g(): ...\n",
        "pkg/d.py": "import pkg.a\nfrom pkg.c import g\n",  # into the circle, not part of it
    })
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert _cycles(graph) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a"]


def test_the_cycle_check_passes_a_tree_without_circles(tmp_path: Path) -> None:
    _fake_tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import x\n",  # a package naming its own module is no circle
        "pkg/a.py": "from pkg import b\nfrom pkg.b import y as x\n",
        "pkg/b.py": "import os\ny = 1\n",
        "pkg/sub/__init__.py": "from .. import b\n",  # pkg.b
    })
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.sub"] == {"pkg.b"}
    assert _cycles(graph) == []


def test_the_size_checks_find_a_501_line_file_and_an_81_line_function(tmp_path: Path) -> None:
    def function(name: str, lines: int, indent: str = "") -> str:  # ``lines`` from its def to its last line
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))

    _fake_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/long.py": "x = 1\n" * 501,
        "pkg/fits.py": "x = 1\n" * 500,
        "pkg/fn.py": function("fits", 80) + "class C:\n" + function("big", 81, "    "),
        "pkg/tests/test_long.py": "x = 1\n" * 600 + function("big", 90),
        "pkg/migrations/versions/v1.py": function("upgrade", 600),
    })
    assert _long_files(tmp_path, ("pkg",)) == ["pkg/long.py (501 lines)"]
    assert _long_functions(tmp_path, ("pkg",)) == ["pkg/fn.py:82 C.big (81 lines)"]


# --------------------------------------------------------------------------------------------------
# Test modules stand alone: what several share lives in a helper module or a conftest.py
# --------------------------------------------------------------------------------------------------


def _test_module_imports(root: Path, folder: str = "tests") -> list[str]:
    """``path:line module`` of each import, in a test module (``test_*.py`` under ``root/folder``; in
    functions too), of a module whose last component starts with ``test_``: ``import tests.x.test_y``,
    ``from tests.x.test_y import f``, ``from .test_y import f``, and ``from tests.x import test_y`` (a test
    module, or a test that pytest would then collect twice)."""
    out = []
    for path in sorted((root / folder).rglob("test_*.py")):
        module = _dotted(path, root)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _import_base(node, module, is_package=False)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            out += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                    if name.rsplit(".", 1)[-1].startswith("test_")]
    return out


def test_no_test_module_imports_another() -> None:
    found = _test_module_imports(ROOT)
    assert found == [], ("test modules importing another test module (move what they share to a helper "
                         "module or a conftest.py next to it):\n" + "\n".join(found))


def test_the_test_import_check_finds_each_form_of_one_test_module_importing_another(tmp_path: Path) -> None:
    _fake_tree(tmp_path, {
        "tests/__init__.py": "",
        "tests/a/__init__.py": "",
        "tests/a/test_one.py": "def f(): ...\n",
        "tests/a/helpers.py": "from tests.a.test_one import f\n",  # not a test module: not scanned
        "tests/a/test_two.py": "from tests.a.test_one import f\nimport tests.a.test_one\n",
        "tests/a/test_three.py": "def g():\n    from .test_one import f\n    return f\n",  # deferred
        "tests/a/test_four.py": "from tests.a import helpers, test_one\n",
        "tests/a/test_five.py": "import os\nfrom . import helpers\nfrom .helpers import f\n"
                                "from tests.test_data.helpers import x\n",  # helpers only: passes
        "tests/b/__init__.py": "",
        "tests/b/test_six.py": "from ..a.test_one import f as g\n",
    })
    assert _test_module_imports(tmp_path) == [
        "tests/a/test_four.py:1 tests.a.test_one",
        "tests/a/test_three.py:2 tests.a.test_one",
        "tests/a/test_two.py:1 tests.a.test_one",
        "tests/a/test_two.py:2 tests.a.test_one",
        "tests/b/test_six.py:1 tests.a.test_one",
    ]
