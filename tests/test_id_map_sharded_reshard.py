"""Id-mapped tables sharded: `recopt-reshard` of a DMP checkpoint from 2 ranks row-wise to 3
ranks table-row-wise keeps every row's id, weight and optimizer state (the global picture;
moving the ids to their new owner shards is `id_map_relocate`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from test_id_map_sharded import STEPS, _dmp, _full, _train

from recopt.testing import run_on_ranks


def _full_states(dmp: Any) -> dict[str, torch.Tensor]:
    """Every model tensor and fused optimizer state as a full tensor."""
    out = {k: _full(v) for k, v in dmp.state_dict().items()}
    for param, states in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            out[f"{param}/{name}"] = _full(value)
    return out


def _save_at(rank: int, world: int, root: str, kind: str) -> dict[str, torch.Tensor]:
    from recopt.checkpoint import save

    dmp, dense = _dmp(kind, world)
    _train(dmp, dense, rank, range(STEPS))
    save(Path(root) / "ck", dmp, {"fused": dmp.fused_optimizer}, step=STEPS)
    return _full_states(dmp)


def _load_at(rank: int, world: int, root: str, kind: str) -> dict[str, torch.Tensor]:
    from recopt.checkpoint import load

    dmp, _ = _dmp(kind, world)
    load(Path(root) / "resharded", dmp, {"fused": dmp.fused_optimizer})
    return _full_states(dmp)


def test_reshard_two_to_three_ranks_keeps_every_ids_row_and_state(tmp_path: Path) -> None:
    from recopt.checkpoint.reshard import reshard

    saved = run_on_ranks(_save_at, 2, str(tmp_path), "row_wise", timeout_s=270.0)[0]
    reshard(tmp_path / "ck", tmp_path / "resharded", world_size=3)
    loaded = run_on_ranks(_load_at, 3, str(tmp_path), "table_row_wise", timeout_s=270.0)
    assert int(saved["sparse.id_maps.t1.occupied"].sum()) > 0
    for state in loaded:
        assert sorted(state) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(state[key].to(value.dtype), value), key
