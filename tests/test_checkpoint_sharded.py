"""Checkpoints of the real DistributedModelParallel: every sharding type, 2 -> 3 -> 1 ranks.

A model (fused-Adam embedding tables + a dense layer with a name-keyed Adam, under a
WarmupOptimizer) trains 2 steps on 2 ranks with a mixed plan and is saved. Resumed from that
checkpoint it trains on exactly as the uninterrupted run. On 3 ranks it goes through a chain
table-wise -> row-wise -> column-wise -> table-row-wise -> data-parallel -> table-wise (each
loading the previous one's checkpoint), and an offline-resharded copy loads too: every weight
and optimizer state stays bit-identical. The last checkpoint loads into the unsharded model in
one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import full_state, random_batch
from torch import nn

from recopt.checkpoint import load, save
from recopt.checkpoint.reshard import reshard
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper, WarmupOptimizer, WarmupStage
from recopt.sharding import (
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=13, embedding_dim=8, feature_names=("f1",)),
    EmbeddingBagConfig(name="t2", num_embeddings=7, embedding_dim=4, feature_names=("f2",)),
]
ROWS = {"f0": 11, "f1": 13, "f2": 7}


def plan(kind: str, world: int) -> ShardingPlan:
    last = world - 1
    requests: dict[str, Any] = {
        "table_wise": {"t0": table_wise(0), "t1": table_wise(last), "t2": table_wise(0)},
        "row_wise": {t.name: row_wise() for t in TABLES},
        "column_wise": {
            "t0": column_wise([last, 0]),
            "t1": column_wise([0]),
            "t2": column_wise([last]),
        },
        "table_row_wise": {t.name: table_row_wise(0) for t in TABLES},
        "data_parallel": {t.name: data_parallel() for t in TABLES},
        "mixed": {"t0": row_wise(), "t1": column_wise([last, 0]), "t2": data_parallel()},
    }[kind]
    return ShardingPlan({"sparse": construct_module_sharding_plan(TABLES, requests, world)})


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3)
        self.sparse = FusedEmbeddingBagCollection(TABLES, optimizer=config)
        self.dense = nn.Linear(20, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).square().mean()


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    return random_batch(ROWS, rank, step)


def build(kind: str, world: int) -> tuple[nn.Module, WarmupOptimizer]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    dmp = DistributedModelParallel(Model(), plan(kind, world))
    dense = KeyedOptimizerWrapper(
        dict(dmp.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01)
    )
    stages = [WarmupStage(max_iters=3, value=0.2)]
    return dmp, WarmupOptimizer(CombinedOptimizer([dmp.fused_optimizer, dense]), stages, lr=1.0)


def train(model: nn.Module, opt: WarmupOptimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(batch(rank, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k].to(b[k].dtype), b[k])]


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = build("mixed", world)
    train(model, opt, rank, range(2))
    save(Path(root) / "ck", model, opt, extra={"position": 2}, step=2)
    saved = full_state(model, opt)
    uninterrupted = train(model, opt, rank, range(2, 5))

    model, opt = build("mixed", world)
    assert load(Path(root) / "ck", model, opt) == {"position": 2}
    assert opt.iteration == 2
    resumed_diff = _diff(full_state(model, opt), saved)
    resumed = train(model, opt, rank, range(2, 5))
    other, other_opt = build("column_wise", world)
    load(Path(root) / "ck", other, other_opt)
    return {
        "saved": saved,
        "resumed_diff": resumed_diff,
        "same_losses": resumed == uninterrupted,
        "column_wise_diff": _diff(full_state(other, other_opt), saved),
    }


def _three_ranks(rank: int, world: int, root: str, saved: dict) -> dict[str, list[str]]:
    out = {}
    # A chain: each checkpoint is saved by the previous layout and loaded by the next.
    previous = Path(root) / "ck"
    chain = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
    for i, kind in enumerate((*chain, "table_wise")):
        model, opt = build(kind, world)
        load(previous, model, opt)
        out[f"{previous.name} -> {kind}"] = _diff(full_state(model, opt), saved)
        previous = Path(root) / f"chain{i}"
        save(previous, model, opt, step=2)
    model, opt = build("table_wise", world)
    load(Path(root) / "offline3", model, opt)
    out["offline"] = _diff(full_state(model, opt), saved)
    return out


def test_sharded_model_round_trips_and_resumes(tmp_path: Path) -> None:
    two = run_on_ranks(_two_ranks, 2, str(tmp_path), timeout_s=240)
    for result in two:
        assert result["resumed_diff"] == [] and result["column_wise_diff"] == []
        assert result["same_losses"]
    saved = two[0]["saved"]
    assert saved["__warmup/warmup"].tolist() == [2, 0]  # [iteration, stage]; resumed: stage 1

    reshard(tmp_path / "ck", tmp_path / "offline3", world_size=3, plan=plan("table_wise", 3))
    three = run_on_ranks(_three_ranks, 3, str(tmp_path), saved, timeout_s=240)
    for result in three:
        assert all(bad == [] for bad in result.values()), result

    # 3 ranks -> 1 process, no process group: the unsharded model and its fused optimizer.
    model = Model()
    dense = KeyedOptimizerWrapper(
        {"dense.weight": model.dense.weight, "dense.bias": model.dense.bias},
        lambda ps: torch.optim.Adam(ps, lr=0.01),
    )
    combined = CombinedOptimizer([("sparse", model.sparse.fused_optimizer), dense])
    opt = WarmupOptimizer(combined, [WarmupStage(max_iters=3, value=0.2)], lr=1.0)
    load(tmp_path / "chain5", model, opt)
    assert _diff(full_state(model, opt), saved) == []
