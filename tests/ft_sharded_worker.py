"""The sharded replica group of the fault-tolerance contract test (tests/ft_torchft_groups.py).

`build` shards a small DLRM's tables (row-wise, table-wise, data-parallel; recopt kernels,
fused Adam) over the group's 2 ranks with `DistributedModelParallel`; `batch` is the input of
one data position on one rank (the same on every run, different between groups' seeds).
"""

from __future__ import annotations

import datetime

import torch
from torch import nn

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.models.dlrm import DLRM, DLRMConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sharding import ShardingPlan, construct_module_sharding_plan
from recopt.sharding.model_parallel import DistributedModelParallel
from recopt.sharding.plan_helpers import data_parallel, row_wise, table_wise
from recopt.sparse import KeyedJaggedTensor

ROWS = {"t0": 40, "t1": 30, "t2": 12}


def build(
    seed: int, timeout: datetime.timedelta, id_map: bool = False
) -> tuple[nn.Module, CombinedOptimizer]:
    """``id_map``: the row- and table-wise tables are id-mapped (lru) with a quarter of the
    rows, so their shard maps evict (the data-parallel one cannot be: it stays as it is)."""
    torch.manual_seed(seed)  # the same on the group's ranks, different between groups
    mapped = {"t0", "t1"} if id_map else set()
    tables = [
        EmbeddingBagConfig(
            name=t,
            num_embeddings=n // 4 if t in mapped else n,
            embedding_dim=8,
            feature_names=(f"f{t}",),
            id_map=IdMapConfig(policy="lru") if t in mapped else None,
        )
        for t, n in ROWS.items()
    ]
    optimizer = FusedOptimizerConfig(name="adam", lr=0.05, backend=Backend.RECOPT)
    sparse = FusedEmbeddingBagCollection(tables, optimizer=optimizer)
    model = DLRM(sparse, DLRMConfig(dense_in_features=4, bottom_mlp=(8, 8), top_mlp=(8,)))
    requests = {"t0": row_wise(), "t1": table_wise(1), "t2": data_parallel()}
    path = next(n for n, m in model.named_modules() if m is sparse)
    plan = ShardingPlan(
        {path: construct_module_sharding_plan(tables, requests, 2, module_path=path)}
    )
    dmp = DistributedModelParallel(model, plan=plan, timeout=timeout)
    dense = KeyedOptimizerWrapper(
        dict(dmp.named_parameters()), lambda p: torch.optim.Adam(p, lr=0.01)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, ("dense", dense)])


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed * 10_000 + step * 10 + rank)
    ids = {
        f"f{t}": [torch.randint(0, n, (int(torch.randint(0, 3, (1,), generator=g)),),
                                generator=g).tolist() for _ in range(6)]
        for t, n in ROWS.items()
    }  # fmt: skip
    return torch.randn(6, 4, generator=g), KeyedJaggedTensor.from_id_lists(ids)
