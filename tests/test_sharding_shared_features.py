"""A feature looked up by several tables, beyond the contract test: built on meta and sharded,
planned by the planner (DistributedModelParallel's default plan and `recopt-plan`), saved and
loaded under another plan and by the unsharded model (names are per table, so nothing is keyed
by feature), and a missing shared feature on one rank refused on every rank, nothing changed.

Bag collection: f reads t0 and t1, g reads t0. Embedding collection: f reads e0 and e1, g e1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import full_state
from torch import nn

from recopt.checkpoint import load, save
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
)
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sharding import (
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    validate_plan,
)
from recopt.sharding.planner.cli import main, read_config
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

BAGS = [
    EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=8, feature_names=["f", "g"]),
    EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=4, feature_names=["f"]),
]
ROWS = [
    EmbeddingConfig(name="e0", num_embeddings=9, embedding_dim=4, feature_names=["f"]),
    EmbeddingConfig(name="e1", num_embeddings=7, embedding_dim=4, feature_names=["f", "g"]),
]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        adam = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3)
        self.bags = FusedEmbeddingBagCollection(BAGS, optimizer=adam)
        self.rows = FusedEmbeddingCollection(ROWS, FusedOptimizerConfig(name="row_wise_adagrad"))
        self.dense = nn.Linear(20, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.bags(kjt)
        rows = self.rows(kjt)
        assert pooled.keys() == ["f@t0", "g", "f@t1"], pooled.keys()
        assert list(rows) == ["f@e0", "f@e1", "g"], list(rows)
        sequence = sum(jt.values().square().sum() for jt in rows.values())
        return self.dense(pooled.values()).square().mean() + sequence


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (2 * (2 + rank),), generator=g)
    values = torch.randint(0, 7, (int(lengths.sum()),), generator=g)  # every table has 7 rows
    return KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=lengths)


def build(plan: ShardingPlan | None) -> tuple[Any, CombinedOptimizer]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    dmp = DistributedModelParallel(Model(), plan)  # None: the planner's plan
    dense = KeyedOptimizerWrapper(
        dict(dmp.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=0.01)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _planned_saved_and_loaded(rank: int, world: int, root: str) -> dict[str, Any]:
    from recopt.sharding.input_dist import RemoteInputError

    planned, opt = build(None)
    assert set(planned.plan.plan) == {"bags", "rows"}
    assert set(planned.plan["bags"]) == {"t0", "t1"} and set(planned.plan["rows"]) == {"e0", "e1"}
    for step in range(2):
        loss = planned(batch(rank, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # A shared feature missing on rank 0: every rank raises, nothing is updated.
    before = full_state(planned, opt)
    if rank == 0:
        with pytest.raises(ValueError, match=r"missing features \['f'\]"):
            planned(KeyedJaggedTensor(["g"], torch.tensor([1]), lengths=torch.tensor([1])))
    else:
        with pytest.raises(RemoteInputError, match=r"rank\(s\) \[0\]"):
            planned(batch(rank, 2))
    # The same through the sharded embedding collection alone: this rank's own error.
    if rank == 0:
        with pytest.raises(ValueError, match=r"missing features \['f'\]; it has \['g'\]"):
            planned.plain_module.rows(
                KeyedJaggedTensor(["g"], torch.tensor([1]), lengths=torch.tensor([1]))
            )
    else:
        with pytest.raises(RemoteInputError, match=r"rank\(s\) \[0\]"):
            planned.plain_module.rows(batch(rank, 2))
    after = full_state(planned, opt)
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    save(Path(root) / "ck", planned, opt, step=2)
    explicit = ShardingPlan(
        {
            "bags": construct_module_sharding_plan(
                BAGS, {"t0": row_wise(), "t1": row_wise()}, world
            ),
            "rows": construct_module_sharding_plan(
                ROWS, {"e0": column_wise([world - 1]), "e1": row_wise()}, world
            ),
        }
    )
    other, other_opt = build(explicit)
    load(Path(root) / "ck", other, other_opt)
    loaded = full_state(other, other_opt)
    return {
        "unchanged": unchanged,
        "saved": before,
        "loaded_diff": [k for k, v in before.items() if not torch.equal(loaded[k], v)],
        "same_keys": sorted(loaded) == sorted(before),
    }


def _both(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """This file's two spawned checks on one group (spawning is most of their cost)."""
    return {
        "meta": _meta_then_shard(rank, world),
        "planned": _planned_saved_and_loaded(rank, world, root),
    }


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The checkpoint root `_planned_saved_and_loaded` saved under, and per rank `_both`."""
    root = tmp_path_factory.mktemp("shared_features")
    results: list[dict[str, Any]] = run_on_ranks(_both, 2, str(root), timeout_s=240)
    return root, results


def test_planned_checkpointed_and_bad_input_refused_on_every_rank(
    spawned: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, both = spawned
    results = [rank_results["planned"] for rank_results in both]
    for result in results:
        assert result["unchanged"] and result["same_keys"] and result["loaded_diff"] == []
    # 2 ranks -> 1 process: the unsharded model loads the same weights and optimizer state.
    model = Model()
    dense = KeyedOptimizerWrapper(
        {"dense.weight": model.dense.weight, "dense.bias": model.dense.bias},
        lambda ps: torch.optim.SGD(ps, lr=0.01),
    )
    opt = CombinedOptimizer(
        [("bags", model.bags.fused_optimizer), ("rows", model.rows.fused_optimizer), dense]
    )
    load(root / "ck", model, opt)
    mine = full_state(model, opt)
    saved = results[0]["saved"]
    assert sorted(mine) == sorted(saved)
    for key, value in saved.items():
        torch.testing.assert_close(mine[key].to(value.dtype), value, atol=0, rtol=0)


def test_recopt_plan_plans_tables_sharing_a_feature(tmp_path: Path) -> None:
    config = tmp_path / "model.toml"
    config.write_text(
        "".join(
            f'[[embedding.tables]]\nname = "{t.name}"\nnum_embeddings = {t.num_embeddings}\n'
            f"embedding_dim = {t.embedding_dim}\nfeature_names = {list(t.feature_names)}\n"
            for t in BAGS
        )
    )
    out = tmp_path / "plan.json"
    assert main([str(config), "--world-size", "2", "--output", str(out)]) == 0
    plan = ShardingPlan.load(out)
    tables = read_config(str(config)).tables
    assert [t.feature_names for t in tables] == [("f", "g"), ("f",)]
    module = next(iter(plan.plan))
    assert set(plan[module]) == {"t0", "t1"}
    validate_plan(plan, {module: tables}, 2)


def _meta_then_shard(rank: int, world: int) -> dict[str, Any]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    kjt = KeyedJaggedTensor.from_id_lists({"f": [[1, 2], [3]], "g": [[4], []]})
    bags = FusedEmbeddingBagCollection(BAGS, device="meta")
    rows = FusedEmbeddingCollection(ROWS, device="meta")
    meta_keys = [bags(kjt).keys(), list(rows(kjt))]  # shapes only, the same keys
    pooled = DistributedModelParallel(bags)(kjt)
    looked_up = DistributedModelParallel(rows)(kjt)
    return {
        "meta": meta_keys,
        "keys": [pooled.keys(), list(looked_up)],
        "shapes": [
            tuple(pooled.values().shape),
            [tuple(jt.values().shape) for jt in looked_up.values()],
        ],
    }


def test_built_on_meta_then_sharded_keeps_the_output_keys(
    spawned: tuple[Path, list[dict[str, Any]]],
) -> None:
    for result in [rank_results["meta"] for rank_results in spawned[1]]:
        keys = [["f@t0", "g", "f@t1"], ["f@e0", "f@e1", "g"]]
        assert result["meta"] == result["keys"] == keys
        assert result["shapes"] == [(2, 20), [(3, 4), (3, 4), (1, 4)]]
