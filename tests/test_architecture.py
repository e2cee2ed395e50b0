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
