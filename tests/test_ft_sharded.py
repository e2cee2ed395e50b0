"""Sharded healing state: each rank's local shards travel as plain tensors and land in place.

Sharded replica groups on torchft (2 ranks each: healing rank by rank, dropped steps rolled
back) run in the contract test, tests/test_ft_torchft.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from recopt.ft.healing_state import into_local_shards, to_local_shards
from recopt.sharding.state import make_sharded_tensor


def test_local_shards_travel_as_plain_tensors_and_land_in_place(tmp_path: Path) -> None:
    """`to_local_shards` / `into_local_shards` round trip (world size 1, in process)."""

    def table(a: torch.Tensor, b: torch.Tensor) -> Any:
        pieces = [([0, 0], [2, 4], 0, a), ([2, 0], [3, 4], 0, b)]  # two row shards
        return make_sharded_tensor(pieces, [5, 4], 0, None)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        source = {"w": table(torch.ones(2, 4), torch.full((3, 4), 2.0)), "step": 3, "x": [1.5]}
        buffer = io.BytesIO()
        torch.save(to_local_shards(source), buffer)
        buffer.seek(0)
        received = torch.load(buffer, weights_only=True)  # no ShardedTensor inside
        mine = [torch.zeros(2, 4), torch.zeros(3, 4)]
        current = {"w": table(*mine), "step": 0, "x": [0.0]}
        loaded = into_local_shards(received, current)
        assert loaded["w"] is current["w"] and loaded["step"] == 3 and loaded["x"] == [1.5]
        assert torch.equal(mine[0], torch.ones(2, 4))  # copied into the live shard tensors
        assert torch.equal(mine[1], torch.full((3, 4), 2.0))
        whole = [([0, 0], [5, 4], 0, torch.zeros(5, 4))]  # one shard: another plan
        other_plan = {"w": make_sharded_tensor(whole, [5, 4], 0, None)}
        with pytest.raises(ValueError, match="same sharding plan"):
            into_local_shards(received, other_plan)
        with pytest.raises(ValueError, match="same sharding plan"):
            into_local_shards(received, {"w": torch.zeros(5, 4)})
    finally:
        dist.destroy_process_group()
