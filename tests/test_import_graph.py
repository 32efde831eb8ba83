"""Dependencies point one way: no module of ifrt/, coordinator/, plugins/ or bench/ imports, even lazily inside a
function or only for type checking, a module that imports it back."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("ifrt", "coordinator", "plugins")


def modules() -> dict[str, Path]:
    """Every hand-written module of the packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "_generated" not in parts:
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``name`` imports anywhere in its text (``from pkg import mod`` counts as ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known and n != name}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_circle_through_a_lazy_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert {"ifrt.client", "ifrt.session", "coordinator.service"} <= set(graph)
    assert "ifrt.session" in graph["ifrt.client"]  # the finder reads imports at all
    assert circles(graph) == []


def test_no_bench_module_imports_one_that_imports_it_back():
    """bench/'s scripts import each other by file name (a script's folder is on its sys.path)."""
    known = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert {"discovery_runs", "discovery_hosts"} <= graph["discovery"]  # the finder reads bench's imports at all
    assert circles(graph) == []


def borrowed_names(path: Path, known: dict[str, Path]) -> list[str]:
    """Each ``from module import name`` of ``path`` whose module only imported ``name`` itself (a package's
    ``__init__`` is its public face and may)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        source = known.get(node.module or "") if isinstance(node, ast.ImportFrom) and not node.level else None
        if source is None or source.name == "__init__.py":
            continue
        found += [f"{path}:{node.lineno}: {a.name} from {node.module}" for a in node.names
                  if a.name in imported_names(source) and f"{node.module}.{a.name}" not in known]
    return found


@functools.cache
def imported_names(path: Path) -> frozenset[str]:
    """The names ``path``'s top level binds by importing them."""
    return frozenset(a.asname or a.name for n in ast.parse(path.read_text()).body
                     if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names)


def test_the_finder_sees_a_name_taken_from_a_module_that_only_imported_it(tmp_path):
    (tmp_path / "home.py").write_text("NAME = 1\n")
    (tmp_path / "middle.py").write_text("from home import NAME\n\nOTHER = NAME\n")
    (tmp_path / "user.py").write_text("from middle import NAME, OTHER\n")
    known = {m: tmp_path / f"{m}.py" for m in ("home", "middle")}
    assert borrowed_names(tmp_path / "user.py", known) == [f"{tmp_path / 'user.py'}:1: NAME from middle"]


def test_names_are_imported_from_the_module_that_defines_them():
    known = {**modules(), **{f"tests.{p.stem}": p for p in (ROOT / "tests").glob("*.py")}}
    users = [p for folder in (*PACKAGES, "tests", "bench", "examples") for p in (ROOT / folder).rglob("*.py")
             if "_generated" not in p.parts]
    assert [b for p in users for b in borrowed_names(p, known)] == []


def test_no_test_module_imports_another():
    test_modules = {f"tests.{p.stem}" for p in (ROOT / "tests").glob("test_*.py")}
    found = [f"{p.name}: {name}" for p in (ROOT / "tests").glob("*.py")
             for name in imports(f"tests.{p.stem}", p, dict.fromkeys(test_modules, p)) if name in test_modules]
    assert found == []
