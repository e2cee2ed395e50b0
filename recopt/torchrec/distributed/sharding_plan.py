"""``torchrec.distributed.sharding_plan``: recopt's hand-written plan helpers.

recopt's helpers take a module's tables, not the module: ``construct_module_sharding_plan(
module, per_param_sharding, world_size=...)`` here reads the tables from the module and
calls recopt's; ``table_wise(rank)``, ``row_wise()``, ``column_wise(ranks)``,
``data_parallel()``, ``table_row_wise(host_index)`` are recopt's requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from recopt.sharding import (
    ParameterSharding,
    ShardingRequest,
    column_wise,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recopt.sharding import construct_module_sharding_plan as _construct

__all__ = [
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
]


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ShardingRequest],
    sharder: Any = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> dict[str, ParameterSharding]:
    """One module's plan (table -> `ParameterSharding`) from its per-table requests.

    ``world_size`` defaults to the world's; wrap the result as
    ``ShardingPlan({"path.to.module": result})``.

    Raises:
        ValueError: ``module`` has no ``tables`` (not an embedding collection).
        PlanError: as recopt's `construct_module_sharding_plan`.
    """
    tables = getattr(module, "tables", None)
    if tables is None:
        raise ValueError(
            f"construct_module_sharding_plan: {type(module).__name__} is not an embedding "
            "collection; pass the EmbeddingBagCollection / EmbeddingCollection itself"
        )
    world = world_size if world_size is not None else dist.get_world_size()
    return _construct(list(tables), per_param_sharding, world, local_size)
