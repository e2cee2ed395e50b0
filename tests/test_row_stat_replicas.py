"""Row-wise optimizer state of column shards is one statistic, the same bits on every shard.

A column-sharded table under row-wise Adagrad / Adam keeps a copy of each row's statistic on
every rank holding one of its column shards; a checkpoint keeps one copy. The copies must agree
bit for bit, or a resumed run drifts from an uninterrupted one (at 3 shards a sum of partials
taken in each rank's own order rounds differently on each rank). 3 gloo ranks: after training,
every copy is equal, and a checkpoint resumed mid-run ends where the uninterrupted run ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipeline_helpers import TinyModel, local_tensors, make_batch, plain_loop, same, tables

from recopt.testing import run_on_ranks

OPTIMIZERS = ["row_wise_adagrad", "row_wise_adam"]


def _build(world: int, optimizer: str) -> tuple[Any, torch.optim.Optimizer]:
    from recopt.kernels import FusedOptimizerConfig
    from recopt.modules import EmbeddingBagCollection
    from recopt.sharding import (
        DistributedModelParallel,
        ShardingPlan,
        column_wise,
        construct_module_sharding_plan,
        table_column_wise,
    )

    torch.manual_seed(0)
    configs = tables()
    requests = {
        t.name: column_wise(list(range(world))) if i % 2 == 0 else table_column_wise(0)
        for i, t in enumerate(configs)
    }
    plan = ShardingPlan(
        {"embedding_bags": construct_module_sharding_plan(configs, requests, world)}
    )
    model = TinyModel(EmbeddingBagCollection(configs))
    fused = FusedOptimizerConfig(name=optimizer, lr=0.1)
    dmp = DistributedModelParallel(model, plan, default_optimizer=fused)
    return dmp, torch.optim.SGD(dmp.parameters(), lr=0.1)


def _row_states(model: Any) -> list[torch.Tensor]:
    """This rank's per-row optimizer states of its column shards (kernel order)."""
    from recopt.sharding import ShardedEmbeddingBagCollection

    sharded = next(m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    return [
        value.clone()
        for kernel in sharded.kernels()
        for states in kernel.split_optimizer_states()
        for value in states.values()
        if value.dim() == 1 and value.numel() > 1  # per row (a step counter is one element)
    ]


def _state(model: Any) -> list[torch.Tensor]:
    return local_tensors(model.state_dict()) + local_tensors(model.fused_optimizer.state_dict())


def _run(rank: int, world: int, tmp: str) -> dict[str, bool]:
    from recopt.checkpoint import load, save

    result = {}
    batches = [make_batch(rank, i) for i in range(6)]
    for name in OPTIMIZERS:
        model, optimizer = _build(world, name)
        plain_loop(model, optimizer, batches[:3])
        path = Path(tmp) / name
        save(path, model, {"dense": optimizer, "fused": model.fused_optimizer})
        rest = plain_loop(model, optimizer, batches[3:])
        # the copies on the ranks (each rank's column shards hold every row)
        mine = _row_states(model)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [t.tolist() for t in mine])
        result[f"{name}: copies equal"] = all(g == gathered[0] for g in gathered) and bool(mine)
        uninterrupted = _state(model)
        model, optimizer = _build(world, name)
        load(path, model, {"dense": optimizer, "fused": model.fused_optimizer})
        resumed = plain_loop(model, optimizer, batches[3:])
        result[f"{name}: resumed"] = same(rest, resumed) and same(uninterrupted, _state(model))
    return result


@pytest.mark.multiprocess
def test_row_statistics_of_column_shards_agree_and_resume_exactly(tmp_path: Path) -> None:
    results = run_on_ranks(_run, 3, str(tmp_path), timeout_s=240.0)
    failures = [(rank, k) for rank, r in enumerate(results) for k, ok in r.items() if not ok]
    assert not failures, failures
