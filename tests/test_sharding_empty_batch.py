"""A rank whose batch is empty (the last, short batch of a data split) still steps with the rest.

Its output is ``[0, dim]`` and the other ranks' outputs and every update are those of a step
where that rank had bags but no ids (a path the contract test covers). It used to crash in
the input exchange (``view(-1, 0)`` of zero lengths) and hang the other ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recopt.kernels import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=4, feature_names=(f"f{i}",))
    for i in range(3)
]
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]


def _batch(rank: int, empty: str) -> KeyedJaggedTensor:
    """Rank 1: three bags per feature; rank 0: none (``"batch"``) or three empty ones."""
    keys = [t.feature_names[0] for t in TABLES]
    if rank == 0:
        size = 0 if empty == "batch" else 3
        lengths = torch.zeros(len(keys) * size, dtype=torch.int64)
        return KeyedJaggedTensor(
            keys=keys, values=torch.zeros(0, dtype=torch.int64), lengths=lengths
        )
    lengths = torch.tensor([1, 2, 0] * len(keys))
    values = torch.arange(int(lengths.sum())) * 7 % 40
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def _step(rank: int, world: int, kind: str, empty: str) -> dict[str, Any]:
    from recopt.sharding import (
        ShardedEmbeddingBagCollection,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )

    kinds = {
        "table_wise": [table_wise(0), table_wise(1), table_wise(0)],
        "row_wise": [row_wise()] * 3,
        "column_wise": [column_wise([0, 1])] * 3,
        "data_parallel": [data_parallel()] * 3,
        "mixed": [row_wise(), column_wise([1, 0]), data_parallel()],
    }
    requests = {t.name: request for t, request in zip(TABLES, kinds[kind], strict=True)}
    plan = construct_module_sharding_plan(TABLES, requests, world)
    torch.manual_seed(1)
    module = ShardedEmbeddingBagCollection(
        TABLES, plan, optimizer=FusedOptimizerConfig(name="adagrad", lr=0.1)
    )
    out = module(_batch(rank, empty)).values()
    (out.square().sum() + out.sum()).backward()
    return {"out": out.detach(), "weights": _local_state(module)}


def _local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every weight: its shards, or the whole replica (data-parallel)."""
    state = {}
    for key, value in module.state_dict().items():
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            state[key] = value.detach().flatten()
        elif value.local_shards():
            state[key] = torch.cat([s.tensor.detach().flatten() for s in value.local_shards()])
    return state


def _every_step(rank: int, world: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Every kind's step with rank 0's batch empty and with its bags empty, each on a module
    built afresh: one spawned group for them all (spawning is most of the cost)."""
    return {
        (kind, empty): _step(rank, world, kind, empty)
        for kind in KINDS
        for empty in ("batch", "bags")
    }


@pytest.fixture(scope="module")
def steps() -> list[dict[tuple[str, str], dict[str, Any]]]:
    """Per rank, `_every_step`'s results."""
    results: list[dict[tuple[str, str], dict[str, Any]]] = run_on_ranks(
        _every_step, 2, timeout_s=240
    )
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_with_an_empty_batch_steps_with_the_others(
    kind: str, steps: list[dict[tuple[str, str], dict[str, Any]]]
) -> None:
    empty = [rank_steps[(kind, "batch")] for rank_steps in steps]
    bagged = [rank_steps[(kind, "bags")] for rank_steps in steps]
    assert empty[0]["out"].shape == (0, 12)
    torch.testing.assert_close(empty[1]["out"], bagged[1]["out"], rtol=0, atol=0)
    for rank in range(2):
        for key, value in bagged[rank]["weights"].items():
            torch.testing.assert_close(empty[rank]["weights"][key], value, rtol=0, atol=0)
