"""Design rules of the project, enforced as tests."""

from __future__ import annotations

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "recopt"


def library_files() -> list[pathlib.Path]:
    return sorted(LIBRARY.rglob("*.py"))


def test_library_does_not_print_or_import_examples() -> None:
    offenders = []
    for path in library_files():
        if path.name == "cli.py" or path.name == "__main__.py":
            continue  # command-line entry points talk to the terminal
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path}:{node.lineno}: print()")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("examples"):
                offenders.append(f"{path}:{node.lineno}: imports examples")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("examples") for a in node.names
            ):
                offenders.append(f"{path}:{node.lineno}: imports examples")
    assert not offenders, "\n".join(offenders)


def test_every_library_file_opens_with_a_docstring() -> None:
    missing = [
        str(p) for p in library_files() if ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert not missing, f"files without a module docstring: {missing}"


def test_torch_load_is_never_unrestricted() -> None:
    offenders = []
    for path in library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and getattr(node.func.value, "id", None) == "torch"
            ):
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value
                if not ok:
                    offenders.append(f"{path}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


# The import layering: what each part of recopt may import from the others (lower layers
# first). kernels and optim stand alone, so a kernel or an optimizer never depends on how
# tables are sharded; fault tolerance sits on top of everything.
_ALLOWED_IMPORTS: dict[str, set[str]] = {
    "sparse": set(),
    "kernels": set(),
    "optim": {"comm"},
    "config": set(),
    "metrics": set(),
    "testing": {"comm"},
    "progress": set(),
    "comm": {"kernels", "config"},
    "data": {"sparse", "config"},
    "modules": {"kernels", "optim", "sparse", "config"},
    "models": {"modules", "kernels", "optim", "sparse", "config"},
    "sharding": {"comm", "modules", "kernels", "optim", "sparse", "config", "metrics", "testing"},
    "checkpoint": {
        "comm",
        "sharding",
        "modules",
        "kernels",
        "optim",
        "sparse",
        "config",
        "progress",
    },
    # TorchRec's import paths over recopt (adapters only): nothing in recopt imports it.
    "torchrec": {"modules", "models", "kernels", "optim", "sparse", "sharding"},
    "ft": {
        "comm",
        "checkpoint",
        "sharding",
        "modules",
        "kernels",
        "optim",
        "sparse",
        "config",
        "metrics",
    },
}


def _part_of(path: pathlib.Path) -> str:
    rel = path.relative_to(LIBRARY)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("recopt.")]
    return found


def test_import_layering() -> None:
    offenders = []
    for path in library_files():
        part = _part_of(path)
        if part == "__init__":
            continue  # the package root re-exports
        assert part in _ALLOWED_IMPORTS, f"{path}: add {part!r} to _ALLOWED_IMPORTS"
        for lineno, imported in _imported_parts(ast.parse(path.read_text())):
            if imported != part and imported not in _ALLOWED_IMPORTS[part]:
                offenders.append(f"{path}:{lineno}: recopt.{part} imports recopt.{imported}")
    assert not offenders, "\n".join(offenders)
