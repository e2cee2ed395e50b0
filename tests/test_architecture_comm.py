"""Design rule: torch.distributed collectives and group creation live in one module.

``recopt/comm.py`` decides which device a collective uses for its group (NCCL refuses
CPU tensors, a ``cuda:gloo`` group too); a collective called anywhere else bypasses that
decision, which is how the plan broadcast once broke every multi-GPU run.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWNER = ROOT / "recopt" / "comm.py"
COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "init_process_group",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
}


def _is_distributed(node: ast.expr, aliases: set[str]) -> bool:
    """``dist`` (any alias of torch.distributed) or the attribute chain ``torch.distributed``."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def stray_collectives(source: str, name: str) -> list[str]:
    """Calls of torch.distributed collectives in ``source`` (and names imported from it)."""
    tree = ast.parse(source, filename=name)
    aliases = {"dist"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    found.append(f"{name}:{node.lineno}: imports {alias.name}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in COLLECTIVES
            and _is_distributed(node.func.value, aliases)
        ):
            found.append(f"{name}:{node.lineno}: {node.func.attr}()")
    return found


def test_the_checker_finds_every_spelling() -> None:
    source = (
        "import torch\nimport torch.distributed as dd\nfrom torch.distributed import broadcast\n"
        "dd.all_reduce(t)\ntorch.distributed.barrier()\nimport torch.distributed as dist\n"
        "dist.new_group()\ncomm.all_reduce(t, None)\n"
    )
    found = stray_collectives(source, "x.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports broadcast",
        "all_reduce()",
        "barrier()",
        "new_group()",
    ]


# A TorchRec user's script, kept as such users write it (only its imports differ): it joins
# the process group itself. Nothing else of torch.distributed is allowed there either.
USER_SCRIPT = ROOT / "examples" / "torchrec_style" / "train.py"


def test_no_collective_outside_the_communication_module() -> None:
    files = sorted((ROOT / "recopt").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    offenders = [
        hit
        for path in files
        if path != OWNER
        for hit in stray_collectives(path.read_text(), str(path.relative_to(ROOT)))
        if not (path == USER_SCRIPT and hit.endswith(": init_process_group()"))
    ]
    assert not offenders, "call these through recopt.comm:\n" + "\n".join(offenders)
