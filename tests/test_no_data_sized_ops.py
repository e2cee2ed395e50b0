"""Architecture rule: on the CUDA path a torch op whose output size comes from device data waits
for the device (a host sync the structural read-back count cannot see). Every
`repeat_interleave` in recopt/ passes `output_size`, and `nonzero` / `unique` /
`unique_consecutive` appear only where docs/sharding.md "Host syncs" lists them (or on CPU-only
data), so a new one is a decision, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from recopt.sparse import JaggedTensor

RECOPT = Path(__file__).resolve().parents[1] / "recopt"
DATA_SIZED = {"repeat_interleave", "nonzero", "unique", "unique_consecutive"}

# (file, op) -> why the data-sized form stays. Counts must match: a second use needs a reason.
ALLOWED = {
    # CPU-only data (the synthetic batches are built on the host).
    ("data/synthetic.py", "repeat_interleave"): 3,
    # Error paths: they run only once a check has failed, to name the culprit.
    ("modules/variable_batch.py", "nonzero"): 1,
    ("modules/inputs.py", "nonzero"): 1,
    ("sparse/_checks.py", "nonzero"): 2,
    # docs/sharding.md "Host syncs": a mixed plan's replicated routing (sum of route counts)
    # and its unrouted filter; the column shards' row statistics (sizes the exchange anyway).
    ("sharding/bucketizer.py", "repeat_interleave"): 1,
    ("sharding/bucketizer.py", "nonzero"): 1,
    ("sharding/row_stats.py", "unique_consecutive"): 1,
    # docs/kernels.md: recopt's torch path, a CUDA torch without Triton (Triton's path has
    # none); the native CPU kernel's runs; fault tolerance's snapshots of touched rows
    # (also the rows an id-mapped table's remap chose).
    ("kernels/recopt_backward.py", "unique"): 1,
    ("kernels/recopt_backward.py", "unique_consecutive"): 1,
    ("ft/embedding.py", "unique"): 3,
    # docs/id_map.md: the id map's remap (new ids, free rows, evictions) in torch ops, and the
    # changed slots of its undo record; a sync-free CUDA remap is the open part of issue 26.
    ("modules/id_map.py", "nonzero"): 7,
    ("modules/id_map.py", "unique"): 1,
    # docs/id_map.md: relocating ids after a load, once (not a step): the live rows, the
    # slots leaving and the free rows; its exchange is sized on the host anyway.
    ("sharding/id_map_relocate.py", "nonzero"): 6,
}


def _data_sized_calls() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for path in sorted(RECOPT.rglob("*.py")):
        rel = path.relative_to(RECOPT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            op = node.func.attr
            if op not in DATA_SIZED:
                continue
            if op == "repeat_interleave" and any(k.arg == "output_size" for k in node.keywords):
                continue  # sized on the host
            found[(rel, op)] = found.get((rel, op), 0) + 1
    return found


def test_data_sized_ops_only_where_documented() -> None:
    assert _data_sized_calls() == ALLOWED


def test_to_padded_dense_sizes_its_bag_index_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    jt = JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 0, 1]))
    calls: list[dict[str, object]] = []
    original = torch.repeat_interleave

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return original(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(torch, "repeat_interleave", spy)
    padded = jt.to_padded_dense(desired_length=2)
    assert torch.equal(padded, torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]))
    assert calls and all(c.get("output_size") == 3 for c in calls)
