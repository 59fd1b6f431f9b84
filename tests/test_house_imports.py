"""The package's layout by plane, as its imports keep it.

Read from the source (``ast`` over every .py file of pleserver/ and
pleclient/, relative imports resolved), not by importing anything:

- ``pleserver.data`` (the data plane) imports neither ``pleserver.control``,
  ``pleserver.ops`` nor ``pleserver.devkit``;
- ``pleserver.observe`` imports neither ``pleserver.data`` nor
  ``pleserver.control``;
- within pleserver, only ``pleserver.cli`` (and devkit itself) imports
  ``pleserver.devkit``, which is not the daemon (tests and bench/ are outside
  the package and may);
- ``pleclient`` never imports ``pleserver``: a vLLM worker installs the client
  alone;
- no import cycle among pleserver's modules.

The plane rules hold for every import, wherever it is written. The cycle
rule counts module-level imports only: an import inside a function runs when
the function is called, after both modules are loaded, and one under
``if TYPE_CHECKING:`` never runs, so neither can make a circle at import
time; both are allowed to close one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pleserver", "pleclient")

FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pleserver.data", ("pleserver.control", "pleserver.ops", "pleserver.devkit")),
    ("pleserver.observe", ("pleserver.data", "pleserver.control")),
    ("pleclient", ("pleserver",)),
)
"""(importer, what it may not import), each a package and everything in it."""
DEVKIT = "pleserver.devkit"
DEVKIT_USERS = ("pleserver.cli", DEVKIT)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (or the package, for a name from it)
    line: int
    module_level: bool  # not in a function, not under `if TYPE_CHECKING:`


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_names(root: Path) -> dict[str, Path]:
    """Every module of ``PACKAGES`` under ``root``, by its dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """``name``'s imports of modules in ``modules``: ``from P import m`` is an
    import of ``P.m`` when that is a module, else of ``P``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def add(target: str, node: ast.stmt, module_level: bool) -> None:
        if target in modules:
            found.append(Import(name, target, node.lineno, module_level))

    def walk(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    # `import a.b.c` loads a, a.b and a.b.c: the deepest module counts.
                    parts = alias.name.split(".")
                    for end in range(len(parts), 0, -1):
                        if ".".join(parts[:end]) in modules:
                            add(".".join(parts[:end]), child, module_level)
                            break
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in modules else base, child, module_level)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    walk(ast.Module(body=[statement], type_ignores=[]), False)
                for statement in child.orelse:
                    walk(ast.Module(body=[statement], type_ignores=[]), module_level)
            else:
                walk(child, module_level)

    walk(ast.parse(path.read_text(), str(path)), True)
    return found


def all_imports(root: Path) -> list[Import]:
    modules = module_names(root)
    names = set(modules)
    return [i for name, path in modules.items() for i in imports_of(name, path, names)]


def plane_violations(imports: list[Import]) -> list[str]:
    bad = []
    for i in imports:
        for importer, forbidden in FORBIDDEN:
            if within(i.source, importer) and any(within(i.target, f) for f in forbidden):
                bad.append(f"{i.source}:{i.line} imports {i.target}")
        if within(i.target, DEVKIT) and not any(within(i.source, u) for u in DEVKIT_USERS):
            bad.append(f"{i.source}:{i.line} imports {i.target} (only pleserver.cli may)")
    return bad


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import circles among pleserver's modules at import time (Tarjan's
    strongly connected components of more than one module, or a module that
    imports itself)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.module_level and within(i.source, "pleserver") and within(i.target, "pleserver"):
            graph.setdefault(i.source, set()).add(i.target)
            graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_planes_import_in_their_directions():
    imports = all_imports(REPO)
    assert any(i.source == "pleserver.cli" and within(i.target, DEVKIT) for i in imports)
    assert plane_violations(imports) == []


def test_no_import_cycle_among_pleserver_modules():
    assert cycles(all_imports(REPO)) == []


def test_the_checks_see_a_violation(tmp_path):
    """The checks themselves, on a made-up tree that breaks each rule once (a
    relative import among them), and keeps it where only lazy imports close
    a circle."""
    files = {
        "pleserver/__init__.py": "",
        "pleserver/cli.py": "from pleserver.devkit import demo\n",
        "pleserver/server.py": "from .data import serving\n",
        "pleserver/data/__init__.py": "",
        "pleserver/data/serving.py": "from ..control import sessions\nimport pleserver.server\n",
        "pleserver/data/hints.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pleserver.data import lazy\n"
        ),
        "pleserver/data/lazy.py": "def f():\n    from pleserver.data import hints\n",
        "pleserver/control/__init__.py": "",
        "pleserver/control/sessions.py": "from pleserver.devkit.launcher import ServerLauncher\n",
        "pleserver/observe/__init__.py": "",
        "pleserver/observe/stats.py": "def f():\n    from pleserver.data.hints import x\n",
        "pleserver/devkit/__init__.py": "",
        "pleserver/devkit/demo.py": "from . import launcher\n",
        "pleserver/devkit/launcher.py": "",
        "pleclient/__init__.py": "import pleserver.observe.stats\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = all_imports(tmp_path)
    assert sorted(plane_violations(imports)) == [
        "pleclient:1 imports pleserver.observe.stats",
        "pleserver.control.sessions:1 imports pleserver.devkit.launcher (only pleserver.cli may)",
        "pleserver.data.serving:1 imports pleserver.control.sessions",
        "pleserver.observe.stats:2 imports pleserver.data.hints",
    ]
    assert cycles(imports) == [["pleserver.data.serving", "pleserver.server"]]
