"""``torchrec.distributed.types``: sharding types and plans (recopt's), the sharding
environment, and the base of the sharders TorchRec code passes to the planner and DMP."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.sharding import ParameterSharding, ShardingPlan, ShardingType
from recopt.torchrec.distributed.fused_params import fused_params_config

EmbeddingModuleShardingPlan = dict[str, ParameterSharding]

__all__ = [
    "EmbeddingModuleShardingPlan",
    "ModuleSharder",
    "ParameterSharding",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
]


@dataclass
class ShardingEnv:
    """The ranks a model is sharded over: ``world_size``, this ``rank``, their group."""

    world_size: int
    rank: int
    process_group: dist.ProcessGroup | None = None

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup) -> ShardingEnv:
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg)


class ModuleSharder:
    """What TorchRec's sharders tell recopt: the module types they shard and the fused
    optimizer of ``fused_params`` (recopt's sharded modules do the sharding).

    Args:
        fused_params: fbgemm table-batched-embedding arguments (see `fused_params_config`).
        qcomm_codecs_registry: quantized communication; recopt has none, so only None.

    Raises:
        ValueError: ``fused_params`` recopt cannot honour, or a codec registry.
    """

    module_types: tuple[type[nn.Module], ...] = ()

    def __init__(
        self,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: Mapping[str, Any] | None = None,
        **unsupported: Any,
    ) -> None:
        if qcomm_codecs_registry:
            raise ValueError(
                "qcomm_codecs_registry: recopt does not quantize its collectives; pass None"
            )
        offered = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if offered:
            raise ValueError(f"{type(self).__name__}: {offered} is not offered by recopt")
        self.fused_params = dict(fused_params or {})
        self.optimizer: FusedOptimizerConfig | None = fused_params_config(self.fused_params)

    @property
    def module_type(self) -> type[nn.Module]:
        return self.module_types[0]

    def shards(self, module: nn.Module) -> bool:
        """Whether ``module`` is of a type this sharder handles."""
        return isinstance(module, self.module_types)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Every sharding type recopt offers (TorchRec's names)."""
        return [t.value for t in ShardingType]
