"""One `FusedCollection` contract for every fused embedding collection, and what DMP reads of it.

The plain, unpooled and sharded fused collections all satisfy the Protocol (the plain torch
modules and DMP do not); DMP takes each table's optimizer from the collection's
``table_optimizers()`` (not from parsed parameter names); an embedding collection's lookup
engine names its params by a constructor argument; and a plan is validated once: by the
planner on rank 0 when DMP plans for itself, by DMP on every rank when it is given one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import recopt.sharding.plan_validation as plan_validation
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedCollection,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
)
from recopt.sharding import (
    DistributedModelParallel,
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    ShardingPlan,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recopt.testing import run_on_ranks

BAGS = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=8, feature_names=["f1"]),
]
ROWS = [EmbeddingConfig(name="e0", num_embeddings=10, embedding_dim=4, feature_names=["g0"])]
ADAM = FusedOptimizerConfig(name="adam", lr=0.02)


def test_fused_collections_satisfy_the_protocol_and_plain_ones_do_not() -> None:
    assert isinstance(FusedEmbeddingBagCollection(BAGS), FusedCollection)
    assert isinstance(FusedEmbeddingCollection(ROWS), FusedCollection)
    assert not isinstance(EmbeddingBagCollection(BAGS), FusedCollection)
    assert not isinstance(EmbeddingCollection(ROWS), FusedCollection)
    assert not isinstance(torch.nn.Linear(2, 2), FusedCollection)


def test_table_optimizers_follow_the_param_groups() -> None:
    ebc = FusedEmbeddingBagCollection(BAGS, table_optimizers={"t1": ADAM})
    default = ebc.table_optimizers()["t0"]
    assert ebc.table_optimizers() == {"t0": default, "t1": ADAM}
    for group in ebc.fused_optimizer.param_groups:
        if group["optimizer"] == "adam":
            group["lr"] = 0.5
    assert ebc.table_optimizers()["t1"].lr == 0.5
    assert ebc.table_optimizers()["t0"] == default
    ec = FusedEmbeddingCollection(ROWS, optimizer=ADAM)
    assert ec.table_optimizers() == {"e0": ADAM}


def test_the_lookup_engine_prefix_is_a_constructor_argument() -> None:
    ebc = FusedEmbeddingBagCollection(BAGS, param_prefix="embeddings")
    assert sorted(ebc.fused_optimizer.params) == ["embeddings.t0.weight", "embeddings.t1.weight"]
    ec = FusedEmbeddingCollection(ROWS)
    assert list(ec.fused_optimizer.params) == ["embeddings.e0.weight"]
    assert list(FusedEmbeddingBagCollection(BAGS).fused_optimizer.params)[0].startswith(
        "embedding_bags."
    )


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bags = FusedEmbeddingBagCollection(BAGS, table_optimizers={"t1": ADAM})
        self.rows = FusedEmbeddingCollection(ROWS)


def _validations(
    monkeypatch: pytest.MonkeyPatch, build: Any
) -> tuple[Counter[str], DistributedModelParallel]:
    counts: Counter[str] = Counter()
    original = plan_validation._validate_table

    def counting(ps: Any, table: Any, *args: Any) -> None:
        counts[table.name] += 1
        original(ps, table, *args)

    monkeypatch.setattr(plan_validation, "_validate_table", counting)
    return counts, build()


def _on_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plan = ShardingPlan(
        {
            "bags": construct_module_sharding_plan(
                BAGS, {"t0": row_wise(), "t1": table_wise(world - 1)}, world
            ),
            "rows": construct_module_sharding_plan(ROWS, {"e0": table_wise(0)}, world),
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        planned, dmp = _validations(patch, lambda: DistributedModelParallel(_Model()))
    with pytest.MonkeyPatch.context() as patch:
        given, _ = _validations(patch, lambda: DistributedModelParallel(_Model(), plan=plan))
    sharded = dict(dmp.sharded_modules())
    bags = sharded["bags"]
    assert isinstance(bags, ShardedEmbeddingBagCollection)
    assert isinstance(sharded["rows"], ShardedEmbeddingCollection)
    optimizers = {
        name: g["optimizer"]
        for g in bags.fused_optimizer.param_groups
        for name, p in bags.fused_optimizer.params.items()
        if any(p is q for q in g["params"])
    }
    return {
        "planned": dict(planned),
        "given": dict(given),
        "protocol": [isinstance(m, FusedCollection) for m in sharded.values()],
        "dmp_is_one": isinstance(dmp, FusedCollection),
        "optimizers": optimizers,
    }


def test_dmp_validates_a_plan_once_and_keeps_each_tables_optimizer() -> None:
    results = run_on_ranks(_on_ranks, 2, timeout_s=180)
    tables = {"t0": 1, "t1": 1, "e0": 1}
    # Planned for itself: the planner validated on rank 0, nothing else did.
    assert [r["planned"] for r in results] == [tables, {}]
    # Given a plan: DMP validated it on every rank (the sharded twins do not again).
    assert [r["given"] for r in results] == [tables, tables]
    for r in results:
        assert r["protocol"] == [True, True] and not r["dmp_is_one"]
        assert r["optimizers"]["embedding_bags.t1.weight"] == "adam"
        assert r["optimizers"]["embedding_bags.t0.weight"] == "row_wise_adagrad"
