"""Sharded EmbeddingCollection beyond the contract: a model with an EBC and an EC under the
planner's plan, bad input on one rank, checkpoints saved at 2 ranks and loaded at 3 under
another plan (directly and through `recopt-reshard`), and the planner's view of EC tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    InvalidIdError,
)
from recopt.sharding import (
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recopt.sparse import JaggedTensor, KeyedJaggedTensor
from recopt.testing import run_on_ranks

BAG_TABLES = [EmbeddingBagConfig(name="u", num_embeddings=9, embedding_dim=4, feature_names=["u"])]
EC_TABLES = [
    EmbeddingConfig(name="s", num_embeddings=11, embedding_dim=4, feature_names=["s0", "s1"]),
    EmbeddingConfig(name="q", num_embeddings=7, embedding_dim=6, feature_names=["q"]),
]


class TwoCollections(nn.Module):
    """Pooled user features and unpooled sequence features, one dense layer over both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = FusedEmbeddingBagCollection(
            BAG_TABLES, optimizer=FusedOptimizerConfig(name="adagrad", lr=0.1)
        )
        self.ec = FusedEmbeddingCollection(
            EC_TABLES, optimizer=FusedOptimizerConfig(name="row_wise_adam", lr=0.05)
        )
        self.dense = nn.Linear(4, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt).values()
        rows = self.ec(kjt)
        seq = torch.cat([rows["s0"].values(), rows["s1"].values()])
        return self.dense(pooled).sum() + self.dense(seq).square().sum() + rows["q"].values().sum()


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    size = 2 + rank
    ids: dict[str, list[list[int]]] = {}
    for f, rows in (("u", 9), ("s0", 11), ("s1", 11), ("q", 7)):
        lengths = torch.randint(0, 4, (size,), generator=g).tolist()
        ids[f] = [torch.randint(0, rows, (n,), generator=g).tolist() for n in lengths]
    return KeyedJaggedTensor.from_id_lists(ids)


def plan_a(world: int) -> ShardingPlan:
    return ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(BAG_TABLES, {"u": row_wise()}, world),
            "ec": construct_module_sharding_plan(
                EC_TABLES, {"s": row_wise(), "q": table_wise(world - 1)}, world
            ),
        }
    )


def plan_b(world: int) -> ShardingPlan:
    return ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(BAG_TABLES, {"u": data_parallel()}, world),
            "ec": construct_module_sharding_plan(
                EC_TABLES, {"s": column_wise([1, 2]), "q": row_wise()}, world
            ),
        }
    )


def full_state(dmp: Any) -> dict[str, torch.Tensor]:
    from recopt.sharding.state import full_tensor

    out = {f"model/{k}": full_tensor(v).clone() for k, v in dmp.state_dict().items()}
    for param, states in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            out[f"optim/{param}/{name}"] = full_tensor(value).clone()
    return out


def _save_at_two(rank: int, world: int, root: str) -> None:
    from recopt.checkpoint import save
    from recopt.sharding import DistributedModelParallel, RemoteInputError

    dmp = DistributedModelParallel(TwoCollections(), plan_a(world))
    assert sorted(dmp.state_dict()) == sorted(TwoCollections().state_dict())
    for step in range(2):
        dmp(batch(rank, step)).backward()
    # Bad input on one rank: every rank raises, nothing changes, the next step works.
    before = full_state(dmp)
    bad = batch(rank, 5)
    if rank == 1:
        bad = KeyedJaggedTensor.from_id_lists({"u": [[1]], "s0": [[2]], "s1": [[11]], "q": [[0]]})
        with pytest.raises(InvalidIdError, match="table 's', feature 's1': id 11"):
            dmp(bad)
    else:
        with pytest.raises(RemoteInputError, match=r"rank\(s\) \[1\]"):
            dmp(bad)
    missing = KeyedJaggedTensor.from_id_lists({"u": [[1]], "s0": [[2]], "s1": [[3]]})
    if rank == 0:
        with pytest.raises(ValueError, match=r"missing features \['q'\]"):
            dmp(missing if rank == 0 else batch(rank, 6))
    else:
        with pytest.raises(RemoteInputError, match=r"rank\(s\) \[0\]"):
            dmp(batch(rank, 6))
    after = full_state(dmp)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    dmp(batch(rank, 2)).backward()
    save(Path(root) / "ck", dmp, dmp.fused_optimizer, step=3)
    expected = full_state(dmp)  # a collective: every rank gathers
    if rank == 0:
        torch.save(expected, Path(root) / "expected.pt")


def _load_at_three(rank: int, world: int, root: str) -> list[str]:
    from recopt.checkpoint import load
    from recopt.sharding import DistributedModelParallel

    expected = torch.load(Path(root) / "expected.pt")
    checked = []
    for name in ("ck", "r3"):
        torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
        dmp = DistributedModelParallel(TwoCollections(), plan_b(world))
        load(Path(root) / name, dmp, dmp.fused_optimizer)
        got = full_state(dmp)
        assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=f"{name} {key}")
        dmp(batch(rank, 3)).backward()  # training goes on under the new plan
        checked.append(name)
    # No plan: the planner plans the EC's tables too.
    planned = DistributedModelParallel(TwoCollections())
    assert set(planned.plan.plan) == {"ebc", "ec"} and set(planned.plan["ec"]) == {"s", "q"}
    planned(batch(rank, 4)).backward()
    # A variable batch per feature through the sharded EC: each rank its own strides.
    ids = {"s0": [1, 2, 3][: rank + 1], "s1": [4, 5], "q": [6]}
    vbe = KeyedJaggedTensor.from_jt_dict(
        {
            f: JaggedTensor(torch.tensor(v), lengths=torch.ones(len(v), dtype=torch.int64))
            for f, v in ids.items()
        }
    )
    rows = planned.plain_module.ec(vbe)
    full = full_state(planned)
    for f, table in (("s0", "s"), ("s1", "s"), ("q", "q")):
        expected_rows = full[f"model/ec.embeddings.{table}.weight"][torch.tensor(ids[f])]
        torch.testing.assert_close(rows[f].values(), expected_rows, atol=0, rtol=0)
        assert rows[f].lengths().tolist() == [1] * len(ids[f])
    return checked


@pytest.mark.multiprocess
def test_checkpoint_saved_at_two_ranks_loads_at_three_under_another_plan(tmp_path: Path) -> None:
    from recopt.checkpoint import reshard

    run_on_ranks(_save_at_two, 2, str(tmp_path), timeout_s=240)
    report = reshard(tmp_path / "ck", tmp_path / "r3", world_size=3, plan=plan_b(3))
    assert report.tables == 3  # u, s and q are recognised as tables
    results = run_on_ranks(_load_at_three, 3, str(tmp_path), timeout_s=240)
    assert results == [["ck", "r3"]] * 3


def test_planner_counts_unpooled_ids_as_bags() -> None:
    from recopt.sharding.planner.constraints import ParameterConstraints
    from recopt.sharding.planner.enumerator import table_workload

    constraints = ParameterConstraints(pooling_factor=5.0)
    adam = FusedOptimizerConfig(name="adam")
    pooled = table_workload(BAG_TABLES[0], constraints, 64, adam)
    unpooled = table_workload(EC_TABLES[0], constraints, 64, adam)
    assert (pooled.batch_size, pooled.pooling_factor) == (64, 5.0)
    assert (unpooled.batch_size, unpooled.pooling_factor, unpooled.num_features) == (320, 1.0, 2)


def test_recopt_plan_reads_unpooled_tables(tmp_path: Path) -> None:
    from recopt.sharding.planner.cli import ConfigError, main, read_config

    config = tmp_path / "model.toml"
    config.write_text(
        "[[embedding.tables]]\n"
        'name = "u"\nnum_embeddings = 100\nembedding_dim = 8\nfeature_names = ["u"]\n'
        "[[embedding.tables]]\n"
        'name = "s"\nnum_embeddings = 100\nembedding_dim = 8\nfeature_names = ["s"]\n'
        "unpooled = true\n"
    )
    tables = read_config(str(config)).tables
    assert [type(t) for t in tables] == [EmbeddingBagConfig, EmbeddingConfig]
    assert main([str(config), "--world-size", "2", "--output", str(tmp_path / "plan.json")]) == 0
    assert set(ShardingPlan.load(str(tmp_path / "plan.json"))[""]) == {"u", "s"}
    config.write_text(
        "[[embedding.tables]]\n"
        'name = "s"\nnum_embeddings = 100\nembedding_dim = 8\nfeature_names = ["s"]\n'
        'unpooled = true\npooling = "mean"\n'
    )
    with pytest.raises(ConfigError, match=r"\('s'\): unknown keys \['pooling'\]"):
        read_config(str(config))
