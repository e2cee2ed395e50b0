"""Find a fused embedding module's tables, with views of their weights and optimizer state.

What `FusedEmbeddingGuard` (recopt/ft/embedding.py) and `EmbeddingReplicaSync`
(recopt/ft/replica_sync.py) snapshot, restore and keep identical: the tables of a
`FusedEmbeddingBagCollection`, or the local kernels' shards and replicas of a sharded
collection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.kernels.contract import Kernel
from recopt.kernels.registry import OPTIMIZERS
from recopt.modules.collection import FusedCollection
from recopt.modules.id_map_lookup import IdMaps


def rows_only_update(optimizer_name: str) -> bool:
    """Whether an update changes only the touched rows' state, so snapshots may go by rows.

    Not for optimizers with a dense state (Adafactor decays the row statistic of every row).
    """
    spec = OPTIMIZERS.get(optimizer_name)
    return spec is None or not spec.dense_state


@dataclass(slots=True)
class FusedTable:
    name: str
    features: tuple[str, ...]
    weight: torch.Tensor
    states: dict[str, torch.Tensor]
    rows_only: bool  # per-row state can be snapshotted by rows


def is_sharded(module: nn.Module) -> bool:
    """A collection whose fused weights are ShardedTensors, with local kernels to hook."""
    return isinstance(module, FusedCollection) and any(
        isinstance(p, ShardedTensor) for p in module.fused_optimizer.params.values()
    )


def kernels_of(module: nn.Module) -> list[Kernel]:
    """The module's kernels; it must run its tables on kernels (an embedding twin)."""
    if not isinstance(module, FusedCollection):
        raise ValueError(
            f"{type(module).__name__} has no kernels(); pass a FusedEmbeddingBagCollection or "
            "a ShardedEmbeddingBagCollection"
        )
    return module.kernels()


def kernel_tables(kernel: Kernel) -> list[FusedTable]:
    """The kernel's local tables (shards or replicas) with views of their weight and state."""
    specs = list(kernel.tables)
    weights = kernel.split_embedding_weights()
    states = kernel.split_optimizer_states()
    rows_only = rows_only_update(kernel.optimizer.name)
    return [
        FusedTable(spec.name, (), weight, dict(state), rows_only)
        for spec, weight, state in zip(specs, weights, states, strict=True)
    ]


def id_maps_of(module: nn.Module) -> IdMaps | None:
    """The collection's id maps (on a sharded one this rank's shard maps), None without any."""
    maps = getattr(module, "id_maps", None)
    return maps if isinstance(maps, IdMaps) else None


def scalar_states(module: nn.Module) -> list[torch.Tensor]:
    """Plain 0-dim state tensors of a sharded collection's optimizer (step counters)."""
    if not isinstance(module, FusedCollection):
        return []
    found: dict[int, torch.Tensor] = {}
    for state in module.fused_optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
                if value.dim() == 0:
                    found[id(value)] = value
    return list(found.values())


def collect_tables(module: nn.Module) -> list[FusedTable]:
    if not isinstance(module, FusedCollection):
        raise ValueError(
            f"{type(module).__name__} is no fused collection (no 'fused_optimizer', 'tables', "
            "...); FusedEmbeddingGuard takes a FusedEmbeddingBagCollection or "
            "FusedEmbeddingCollection"
        )
    optimizer, configs = module.fused_optimizer, module.tables
    params: dict[str, torch.Tensor] = dict(optimizer.params)
    optimizer_of: dict[int, str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer_of[id(p)] = str(group.get("optimizer", ""))
    # Param names are "<prefix>.<table>.weight" (embedding_bags, or embeddings for an
    # embedding collection); table names hold no ".".
    by_table = {name.split(".")[-2]: p for name, p in params.items() if name.count(".") == 2}
    tables = []
    for config in configs:
        if config.name not in by_table:
            raise ValueError(
                f"table {config.name!r}: fused_optimizer has no param "
                f"'<prefix>.{config.name}.weight' (it has {sorted(params)})"
            )
        weight = by_table[config.name]
        prefix = f"{config.name}."
        states = {
            k[len(prefix) :]: v
            for k, v in optimizer.state.get(weight, {}).items()
            if isinstance(v, torch.Tensor) and k.startswith(prefix)
        }
        rows_only = rows_only_update(optimizer_of.get(id(weight), ""))
        tables.append(
            FusedTable(config.name, tuple(config.feature_names), weight, states, rows_only)
        )
    return tables
