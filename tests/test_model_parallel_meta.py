"""DistributedModelParallel materialises an EmbeddingBagCollection built on the meta device."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
)
from recopt.sharding import DistributedModelParallel, full_tensor
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks


def _meta_then_shard(rank: int, world: int, fused: bool) -> dict[str, Any]:
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=16, embedding_dim=4, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=8, feature_names=["fb"]),
    ]
    kind = FusedEmbeddingBagCollection if fused else EmbeddingBagCollection
    dmp = DistributedModelParallel(kind(tables, device="meta"))
    kjt = KeyedJaggedTensor.from_id_lists({"fa": [[1, 2], [15]], "fb": [[0], [3, 8]]})
    out = dmp(kjt)
    full = {k: full_tensor(v) for k, v in sorted(dmp.state_dict().items()) if "weight" in k}
    return {"shape": tuple(out.values().shape), "keys": out.keys(), "full": full}


@pytest.mark.parametrize("fused", [False, True])
def test_meta_collection_is_materialised_by_dmp(fused: bool) -> None:
    for world in (1, 2):
        results = run_on_ranks(_meta_then_shard, world, fused, timeout_s=120)
        for result in results:
            assert result["shape"] == (2, 12) and result["keys"] == ["fa", "fb"]
            for name, rows in (("a", 16), ("b", 9)):
                weight = result["full"][f"embedding_bags.{name}.weight"]
                bound = math.sqrt(1.0 / rows)
                assert weight.device.type == "cpu" and weight.shape[0] == rows
                assert float(weight.abs().max()) <= bound and float(weight.abs().max()) > 0
        assert torch.equal(
            results[0]["full"]["embedding_bags.a.weight"],
            results[-1]["full"]["embedding_bags.a.weight"],
        )


def _meta_ec_then_shard(rank: int, world: int) -> dict[str, Any]:
    from recopt.modules import EmbeddingCollection, EmbeddingConfig

    tables = [
        EmbeddingConfig(name="s", num_embeddings=16, embedding_dim=4, feature_names=["s0", "s1"])
    ]
    with torch.device("meta"):
        ec = EmbeddingCollection(tables, need_indices=True)
    meta_out = ec(KeyedJaggedTensor.from_id_lists({"s0": [[1, 2]], "s1": [[3]]}))
    assert meta_out["s0"].values().shape == (2, 4) and meta_out["s0"].values().is_meta
    dmp = DistributedModelParallel(ec)
    out = dmp(KeyedJaggedTensor.from_id_lists({"s0": [[1, 2], [15]], "s1": [[0], []]}))
    weight = full_tensor(dmp.state_dict()["embeddings.s.weight"])
    assert torch.equal(out["s0"].values(), weight[[1, 2, 15]])
    assert torch.equal(out["s1"].values(), weight[[0]])
    assert out["s0"].weights().tolist() == [1, 2, 15]  # need_indices survives the sharding
    return {"weight": weight}


def test_meta_embedding_collection_is_materialised_by_dmp() -> None:
    results = run_on_ranks(_meta_ec_then_shard, 2, timeout_s=120)
    weight = results[0]["weight"]
    assert torch.equal(weight, results[1]["weight"]) and weight.shape == (16, 4)
    assert 0 < float(weight.abs().max()) <= math.sqrt(1.0 / 16)


def _replica_after_row_wise(rank: int, world: int) -> torch.Tensor:
    from recopt.sharding import (
        ShardingPlan,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
    )

    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=17, embedding_dim=4, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=["fb"]),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables, device="meta")
    per_table = {"a": row_wise(), "b": data_parallel()}
    plan = ShardingPlan({"": construct_module_sharding_plan(tables, per_table, world)})
    dmp = DistributedModelParallel(ebc, plan=plan)
    return full_tensor(dmp.state_dict()["embedding_bags.b.weight"]).clone()


def test_meta_data_parallel_replicas_start_equal() -> None:
    # Each rank draws its row-wise shard of `a` (9 or 8 rows) before the replica of `b`.
    first, second = run_on_ranks(_replica_after_row_wise, 2, timeout_s=120)
    assert torch.equal(first, second) and float(first.abs().max()) > 0
