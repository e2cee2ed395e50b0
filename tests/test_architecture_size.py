"""Design rules as tests: no function over 80 lines, no import cycle inside a package at run time.

A cycle hidden by an import inside a function is still a cycle (the package cannot be read, or
split, one module at a time), so imports in function bodies count; only imports under
``if TYPE_CHECKING:`` (never run) do not.
"""

from __future__ import annotations

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "recopt"
MAX_FUNCTION_LINES = 80
# Explicit exclusions: (file relative to recopt/, qualified function name). None today.
LONG_FUNCTION_EXCLUSIONS: set[tuple[str, str]] = set()


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.AST]]:
    found: list[tuple[str, ast.AST]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            found += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((f"{prefix}{node.name}", node))
            found += _functions(node, f"{prefix}{node.name}.")
    return found


def long_functions(root: pathlib.Path, limit: int) -> list[str]:
    """``file:line name (n lines)`` of every function in ``root`` longer than ``limit``."""
    result = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for name, node in _functions(ast.parse(path.read_text())):
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit and (rel, name) not in LONG_FUNCTION_EXCLUSIONS:
                result.append(f"{rel}:{node.lineno} {name} ({lines} lines)")
    return result


def test_no_function_is_over_80_lines() -> None:
    assert not long_functions(LIBRARY, MAX_FUNCTION_LINES)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every module (or module.attribute) imported outside ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)  # the body never runs
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports at run time (``__init__`` aside)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    packages = {n for n, p in modules.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if name in packages else name.rpartition(".")[0]
        imports = _runtime_imports(ast.parse(path.read_text()), name, name in packages)
        graph[name] = {
            m
            for m in imports
            if m in modules and m != name and m not in packages and m.rpartition(".")[0] == package
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each one import cycle or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_package_at_run_time() -> None:
    assert cycles(import_graph(LIBRARY)) == []


def test_the_checks_find_what_they_look_for(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "recopt" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from recopt.pkg.b import f\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recopt.pkg import c\n"
        "def f() -> None:\n    from . import a\n"
    )
    (package / "c.py").write_text("from recopt.pkg import b\n" + "x = 1\n" * 90)
    (package / "d.py").write_text("def g() -> None:\n" + "    x = 1\n" * 80)
    assert cycles(import_graph(tmp_path / "recopt")) == [["recopt.pkg.a", "recopt.pkg.b"]]
    assert long_functions(tmp_path / "recopt", MAX_FUNCTION_LINES) == ["pkg/d.py:1 g (81 lines)"]
