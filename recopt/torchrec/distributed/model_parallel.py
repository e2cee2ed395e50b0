"""``torchrec.distributed.DistributedModelParallel``: TorchRec's signature over recopt's DMP.

``sharders`` contribute their ``fused_params`` optimizer to the tables of the modules they
handle (a table given an optimizer by ``apply_optimizer_in_backward`` keeps that one); with no
``plan`` the planner plans collectively over ``env``'s group; the plan then names every
table's optimizer and recopt's DMP shards by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.sharding import DistributedModelParallel as _RecoptDMP
from recopt.sharding import ShardingPlan
from recopt.torchrec.distributed._tables import table_optimizers
from recopt.torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from recopt.torchrec.distributed.planner.types import Topology
from recopt.torchrec.distributed.types import ModuleSharder, ShardingEnv

__all__ = ["DistributedModelParallel"]


def _with_optimizers(
    plan: ShardingPlan, optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]]
) -> ShardingPlan:
    """``plan`` with each table's optimizer set where the plan names none."""
    result = {}
    for path, shardings in plan.plan.items():
        chosen = optimizers.get(path, {})
        result[path] = {
            table: sharding
            if sharding.optimizer is not None or table not in chosen
            else dataclasses.replace(sharding, optimizer=chosen[table])
            for table, sharding in shardings.items()
        }
    return ShardingPlan(result)


class DistributedModelParallel(_RecoptDMP):
    """Shards ``module``'s embedding collections over ``env``'s ranks, DDP for the rest.

    Args:
        module: the unsharded model, identical on every rank (modified in place).
        env: the ranks (default: the world).
        device: where shards and the dense part live (default: CPU).
        plan: the sharding plan (default: `EmbeddingShardingPlanner`'s collective plan for
            ``device``'s type).
        sharders: give the tables of the modules they handle their ``fused_params``
            optimizer; a module without a sharder is sharded too, with recopt's defaults.
        init_data_parallel: only True (recopt wraps the dense part in DDP at once).
        init_parameters: accepted; a module on meta is always materialised.
        Others (``data_parallel_wrapper``, ``model_tracker_configs``): only None.

    Raises:
        ValueError: an argument recopt does not offer, or an optimizer it cannot map (named).
        PlanError, PlannerError: as recopt's `DistributedModelParallel`.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | str | None = None,
        plan: ShardingPlan | None = None,
        sharders: Sequence[ModuleSharder] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        **unsupported: Any,
    ) -> None:
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given or not init_data_parallel:
            raise ValueError(
                f"DistributedModelParallel: {given or ['init_data_parallel=False']} is not "
                "offered by recopt (the dense part is wrapped in DDP at construction)"
            )
        pg = env.process_group if env is not None else None
        optimizers = table_optimizers(module, sharders)
        if plan is None:
            device_type = torch.device(device).type if device is not None else "cpu"
            planner = EmbeddingShardingPlanner(Topology(dist.get_world_size(pg), device_type))
            plan = planner.collective_plan(module, sharders, pg)
        super().__init__(
            module, _with_optimizers(plan, optimizers), process_group=pg, device=device
        )
