"""Package boundaries of docs/ARCHITECTURE.md, the whole layering (arrows point down only):

    operator tools (ops/: cli, localcluster, processes, agentkeeper, netns, bench; and vigil/bench):
    may compose anything, and nothing imports them
    server (controller/)   agent   vigil (the rank runtime and API)   dashboard   examples
    the contract (vigil/contract/): standard library, pydantic, httpx, msgspec; nothing of the above

Agent and dashboard import neither torch nor ray, nor each other, nor the server; the server never
imports the rank runtime, the agent or the dashboard nor the operator tools (``vigil controller``
mounts the dashboard: ops/); every package takes from ``vigil`` only the contract, except the rank
runtime itself and the examples (user code on its API). Checked twice: statically over the sources,
and in a fresh interpreter; each rule is also shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONTRACT = "vigil.contract"
"""The one package every layer may import: wire models, the typed client, settings and the shared paths,
optimizer params, the checkpoint layout, waiting, background loops, link shaping."""
SERVER_LIBS = {"torch", "ray", "sqlalchemy", "fastapi", "alembic"}
RULES: dict[str, set[str]] = {
    # package (a folder, or vigil.contract): what it must not import; ``vigil`` means the rank runtime and
    # API, i.e. all of ``vigil`` but the contract
    "agent": {"torch", "ray", "vigil", "controller", "dashboard", "ops", "examples", "trainer"},
    "dashboard": {"torch", "ray", "vigil", "controller", "agent", "ops", "examples", "trainer"},
    "controller": {"vigil", "examples", "ops", "dashboard", "agent", "trainer"},
    "vigil": {"controller", "examples", "agent", "dashboard", "ops", "trainer"},
    "trainer": {"controller", "agent", "dashboard", "ops", "examples"},
    # Examples are written as a user writes them: the rank API and the contract, nothing internal.
    "examples": {"controller", "agent", "dashboard", "ray", "ops", "trainer"},
    CONTRACT: {"vigil", "controller", "agent", "dashboard", "ops", "examples", "trainer", *SERVER_LIBS},
}
EXEMPT = ("vigil/bench/", "examples/ray_train_unchanged/")
"""Benchmarks are operator tools that compose the packages (they run the examples); the Ray Train example
is code written for Ray Train, which imports ``ray`` as its users do."""


def _modules(path: Path) -> set[str]:
    """Full names of the modules ``path`` imports, anywhere in it (``from ops import netns``: ops.netns;
    relative imports are inside their own package and so never cross a boundary)."""
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


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _breaks(module: str, forbidden: set[str]) -> bool:
    """Whether importing ``module`` crosses a rule: its top name is forbidden, the contract excepted."""
    return module.split(".")[0] in forbidden and not _in(module, CONTRACT)


def _package_files(root: Path, package: str) -> list[Path]:
    base = root / package.replace(".", "/")
    return sorted(p for p in base.rglob("*.py") if not str(p.relative_to(root)).startswith(EXEMPT))


def _violations(root: Path, package: str, forbidden: set[str]) -> dict[str, list[str]]:
    """``path -> [modules]`` of each file of ``package`` importing what ``forbidden`` names."""
    if package == CONTRACT:  # the contract: nothing first-party but itself, not even the rest of vigil
        bad_of = lambda p: {m for m in _modules(p) if m.split(".")[0] in forbidden and not _in(m, CONTRACT)}
    else:
        bad_of = lambda p: {m for m in _modules(p) if _breaks(m, forbidden)}
    return {str(p.relative_to(root)): sorted(bad) for p in _package_files(root, package) if (bad := bad_of(p))}


@pytest.mark.parametrize("package", sorted(RULES))
def test_sources_respect_boundaries(package: str) -> None:
    assert (ROOT / package.replace(".", "/")).is_dir(), f"package {package} not found"
    offenders = _violations(ROOT, package, RULES[package])
    assert offenders == {}, f"{package} imports what it must not: {offenders}"


@pytest.mark.parametrize(("package", "planted", "caught"), [
    ("agent", "from vigil.sdk import init\n", ["vigil.sdk"]),
    ("agent", "import torch\n", ["torch"]),
    ("agent", "def f():\n    from controller import models\n", ["controller.models"]),
    ("dashboard", "from agent.main import main\n", ["agent.main"]),
    ("dashboard", "import vigil\n", ["vigil"]),
    ("controller", "from vigil import runner\n", ["vigil.runner"]),
    ("controller", "from ops.cli import main\n", ["ops.cli"]),
    ("controller", "import dashboard.app\n", ["dashboard.app"]),
    ("vigil", "from controller.models import Job\n", ["controller.models"]),
    ("examples", "import ray\n", ["ray"]),
    (CONTRACT, "from vigil.sdk import init\n", ["vigil.sdk"]),
    (CONTRACT, "import sqlalchemy\n", ["sqlalchemy"]),
    (CONTRACT, "from controller import models\n", ["controller.models"]),
])
def test_each_import_rule_fails_on_a_planted_violation(tmp_path: Path, package: str, planted: str,
                                                      caught: list[str]) -> None:
    folder = tmp_path / package.replace(".", "/")
    folder.mkdir(parents=True)
    (folder / "ok.py").write_text("import os\nfrom vigil.contract.schemas import JobSpec\n")
    assert _violations(tmp_path, package, RULES[package]) == {}
    (folder / "planted.py").write_text(planted)
    rel = str((folder / "planted.py").relative_to(tmp_path))
    assert _violations(tmp_path, package, RULES[package]) == {rel: caught}


RUNTIME = [
    ("agent.main", ["torch", "ray", "vigil", "controller", "dashboard"]),
    ("dashboard.app", ["torch", "ray", "vigil", "controller", "agent"]),
    ("controller.app", ["vigil", "ops", "agent", "dashboard", "dash", "torch"]),
    ("ops.cli", ["vigil", "torch", "ray"]),
    ("vigil.contract.client", ["vigil", "controller", "agent", "dashboard", "ops", *SERVER_LIBS]),
]
_RUNTIME_CHECK = """import importlib, sys
importlib.import_module({module!r})
forbidden, contract = {forbidden!r}, {contract!r}
bad = sorted(m for m in sys.modules if m.split(".")[0] in forbidden
             and m != "vigil" and m != contract and not m.startswith(contract + "."))
print(bad)
sys.exit(1 if bad else 0)
"""


def _runtime_check(module: str, forbidden: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    code = _RUNTIME_CHECK.format(module=module, forbidden=forbidden, contract=CONTRACT)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize(("module", "forbidden"), RUNTIME)
def test_runtime_imports_respect_boundaries(module: str, forbidden: list[str]) -> None:
    """In a fresh interpreter: the ``vigil`` package itself loads (the contract is inside it) but nothing
    of it beyond the contract (``vigil/__init__.py`` loads the rank API only on first use)."""
    r = _runtime_check(module, forbidden, ROOT)
    assert r.returncode == 0, f"importing {module} pulled in {r.stdout.strip()} {r.stderr[-2000:]}"


def test_the_runtime_check_fails_on_a_planted_import(tmp_path: Path) -> None:
    (tmp_path / "planted_mod.py").write_text("import vigil.contract.schemas\nimport vigil.launch_context\n")
    r = _runtime_check("planted_mod", ["vigil"], tmp_path)
    assert r.returncode == 1 and "'vigil.launch_context'" in r.stdout, r.stdout + r.stderr
    assert "vigil.contract" not in r.stdout, r.stdout


def _sources(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]


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


# --------------------------------------------------------------------------------------------------
# One way to stand up the controller in tests: tests/harness.py
# --------------------------------------------------------------------------------------------------

HARNESS = "tests/harness.py"


def _controllers_built_outside_the_harness(root: Path, folder: str = "tests") -> list[str]:
    """``path:line`` of each import of ``controller.app``'s ``create_app`` in a test file other than the
    harness (in functions too): a test builds its controller with :func:`tests.harness.build_app`."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == HARNESS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "controller.app" and any(
                    a.name == "create_app" for a in node.names) or isinstance(node, ast.Import) and any(a.name == "controller.app" for a in node.names):
                out.append(f"{rel}:{node.lineno}")
    return out


def test_tests_build_the_controller_only_through_the_harness() -> None:
    found = _controllers_built_outside_the_harness(ROOT)
    assert found == [], "controller apps built outside tests/harness.py (use build_app):\n" + "\n".join(found)


def test_the_harness_check_finds_a_controller_built_elsewhere(tmp_path: Path) -> None:
    _fake_tree(tmp_path, {
        HARNESS: "from controller.app import create_app\n",
        "tests/a/test_ok.py": "from controller.app import job_env\nfrom dashboard.app import create_app\n",
        "tests/a/test_direct.py": "def f():\n    from controller.app import Mount, create_app\n",
        "tests/b/helpers.py": "import controller.app\n",
    })
    assert _controllers_built_outside_the_harness(tmp_path) == ["tests/a/test_direct.py:2", "tests/b/helpers.py:1"]
