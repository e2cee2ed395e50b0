"""DistributedModelParallel: shard a model's embedding collections by a plan, DDP the rest.

Every (Fused)EmbeddingBagCollection / (Fused)EmbeddingCollection of the model is replaced in
place by its sharded twin holding its current weights, so the sharded model starts equal
to the unsharded one; the dense rest is wrapped in DDP on its own process group (so its
gradient all-reduces never interleave with the sharding collectives).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recopt import comm
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules.embedding import EmbeddingCollection
from recopt.modules.embedding_bag import EmbeddingBagCollection
from recopt.modules.fused import FusedEmbeddingBagCollection
from recopt.modules.fused_embedding import FusedEmbeddingCollection
from recopt.modules.fused_groups import optimizer_from_param_group
from recopt.modules.torch_optimizers import fused_config
from recopt.optim.combined import CombinedOptimizer
from recopt.optim.keyed import KeyedOptimizer
from recopt.sharding.plan import ShardingPlan
from recopt.sharding.plan_helpers import balanced_table_wise_plan
from recopt.sharding.plan_validation import validate_plan
from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_BAG_TYPES = (EmbeddingBagCollection, FusedEmbeddingBagCollection)
_UNPOOLED_TYPES = (EmbeddingCollection, FusedEmbeddingCollection)
_EMBEDDING_TYPES = (*_BAG_TYPES, *_UNPOOLED_TYPES)
ShardedModule = ShardedEmbeddingBagCollection | ShardedEmbeddingCollection


class DistributedModelParallel(nn.Module):
    """A model whose embedding tables are sharded over ranks and whose dense part is DDP.

    Args:
        module: the unsharded model, identical on every rank (same seed); modified in place.
        plan: the sharding plan (default: the planner's for ``device``: on CUDA it plans
            against the GPU's free memory, the least over the ranks, and places tables that
            do not fit in UVM; without the planner, a balanced table-wise plan).
        process_group: the ranks (default: the world).
        device: where shards live (default: CPU).
        default_optimizer: the fused optimizer of the tables of a plain EmbeddingBagCollection
            or EmbeddingCollection whose plan entry names none (default:
            `FusedOptimizerConfig()`). A table given an optimizer by torch's
            ``_apply_optimizer_in_backward(cls, params, kwargs)`` (TorchRec's way) gets the
            fused equivalent of ``cls`` with ``kwargs`` instead.
        ranks_per_host: for host-local sharding types and plan validation.
        timeout: of the dense process group's collectives and of the sharded collections'
            NaN/inf skip vote.

    Raises:
        PlanError: the plan does not fit the model (checked on every rank before any
            collective), or names an optimizer/sharding pair recopt does not support.
        ValueError: an optimizer applied in backward that has no fused equivalent (naming
            the table and the optimizer).
        PlannerError: with no plan given, no plan fits the ranks' memory (on CUDA: neither
            HBM nor, where fbgemm can run the table, UVM); raised on every rank.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: ShardingPlan | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        default_optimizer: FusedOptimizerConfig | None = None,
        ranks_per_host: int | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        world = dist.get_world_size(process_group)
        found = _embedding_modules(module)
        tables_by_module = {path: list(m.tables) for path, m in found}
        if plan is None:
            plan = _default_plan(
                tables_by_module,
                world,
                ranks_per_host,
                default_optimizer,
                process_group,
                device,
                timeout,
                table_optimizers={path: _table_optimizers(m) for path, m in found},
            )
        validate_plan(plan, tables_by_module, world, ranks_per_host)
        self.plan = plan
        sharded: list[tuple[str, ShardedModule]] = []
        for path, old in found:
            new = _shard(old, plan[path], default_optimizer, process_group, device, path, timeout)
            if not _on_meta(old):  # a meta module has no values: keep the fresh init
                new.load_state_dict(old.state_dict())
            module = _replace(module, path, new)
            sharded.append((path, new))
        self._sharded = sharded
        self.__dict__["_plain"] = module  # not registered: `module` below is the one child
        dense = [p for p in module.parameters() if p.requires_grad]
        if dense:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            dense_group = comm.new_group(ranks, timeout)
            self.module: nn.Module = DistributedDataParallel(module, process_group=dense_group)
        else:
            self.module = module
        self._fused = CombinedOptimizer(
            [(path, m.fused_optimizer) if path else m.fused_optimizer for path, m in sharded]
        )

    @property
    def plain_module(self) -> nn.Module:
        """The sharded model without the DDP wrapper."""
        module: nn.Module = self.__dict__["_plain"]
        return module

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """Every sharded collection's fused optimizer, keys equal to the model's parameter names."""
        return self._fused

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes whose fused update was skipped for a NaN/inf gradient (every rank
        agrees); with several sharded collections, the largest of their counts."""
        return max((m.skipped_nonfinite_steps for _, m in self._sharded), default=0)

    def sharded_modules(self) -> list[tuple[str, ShardedModule]]:
        """``(path, module)`` of every sharded collection."""
        return list(self._sharded)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model (DDP-wrapped when it has dense parameters)."""
        return self.module(*args, **kwargs)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The unsharded model's keys (no ``module.`` prefix); sharded tables as ShardedTensors."""
        result: dict[str, Any] = self.plain_module.state_dict(
            *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict with the unsharded model's keys (full tensors or ShardedTensors)."""
        return self.plain_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The dense parameters under the unsharded model's names."""
        return self.plain_module.named_parameters(prefix, recurse, remove_duplicate)


def _embedding_modules(module: nn.Module) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for path, m in module.named_modules():
        inside = any(outer == "" or path.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(m, _EMBEDDING_TYPES) and not inside:
            found.append((path, m))
    return found


def _shard(
    old: nn.Module,
    shardings: Mapping[str, Any],
    default_optimizer: FusedOptimizerConfig | None,
    process_group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    path: str,
    timeout: datetime.timedelta,
) -> ShardedModule:
    """The sharded twin of one embedding collection (its weights not yet copied)."""
    common: dict[str, Any] = {
        "optimizer": default_optimizer,
        "table_optimizers": _table_optimizers(old),
        "process_group": process_group,
        "device": device,
        "module_path": path,
        "skip_nonfinite": getattr(old, "skip_nonfinite", True),
        "timeout": timeout,
    }
    if isinstance(old, _UNPOOLED_TYPES):
        return ShardedEmbeddingCollection(
            old.tables, shardings, need_indices=old.need_indices(), **common
        )
    assert isinstance(old, _BAG_TYPES)
    return ShardedEmbeddingBagCollection(
        old.tables, shardings, is_weighted=old.is_weighted, **common
    )


def _table_optimizers(module: nn.Module) -> dict[str, FusedOptimizerConfig]:
    """The per-table optimizers of a fused collection, read from its param groups, or those
    attached to a plain collection's tables by ``_apply_optimizer_in_backward``."""
    if not isinstance(module, FusedEmbeddingBagCollection | FusedEmbeddingCollection):
        return _in_backward_optimizers(module)
    opt = module.fused_optimizer
    name_of = {id(p): n for n, p in opt.params.items()}
    result: dict[str, FusedOptimizerConfig] = {}
    for group in opt.param_groups:
        config = optimizer_from_param_group(group)
        for p in group["params"]:
            table = name_of[id(p)].split(".")[1]
            result[table] = config
    return result


def _in_backward_optimizers(module: nn.Module) -> dict[str, FusedOptimizerConfig]:
    """Table -> the fused optimizer equal to the one torch's ``_apply_optimizer_in_backward``
    attached to its weight (TorchRec's way of choosing a table's optimizer).

    Raises:
        ValueError: a table with several such optimizers, or one with no fused equivalent
            (naming the table and the optimizer).
    """
    result: dict[str, FusedOptimizerConfig] = {}
    for name, param in module.named_parameters():
        classes = getattr(param, "_optimizer_classes", None)
        if not classes:
            continue
        table = name.split(".")[1]  # embedding_bags.<table>.weight / embeddings.<table>.weight
        if len(classes) > 1:
            raise ValueError(
                f"table {table!r}: {len(classes)} optimizers applied in backward "
                f"({', '.join(c.__name__ for c in classes)}); a fused table runs one, apply one"
            )
        try:
            result[table] = fused_config(classes[0], param._optimizer_kwargs[0])  # type: ignore[attr-defined]
        except ValueError as e:
            raise ValueError(f"table {table!r} (_apply_optimizer_in_backward): {e}") from e
    return result


def _on_meta(module: nn.Module) -> bool:
    """True when the module was built on the meta device (build-on-meta, then shard)."""
    return any(p.device.type == "meta" for p in module.parameters())


def _replace(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    if not path:
        return new
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
    return root


def _default_plan(
    tables_by_module: Mapping[str, list[Any]],
    world: int,
    ranks_per_host: int | None,
    default_optimizer: FusedOptimizerConfig | None,
    process_group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    timeout: datetime.timedelta,
    table_optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]] | None = None,
) -> ShardingPlan:
    """The planner's plan for the device the shards will live on (planned on rank 0).

    `training_topology`: on CPU the planner's default topology (4 GiB per rank); on CUDA this
    GPU's memory (free HBM; host memory over the ranks of a host, for UVM), the least over the
    ranks, so a table set larger than HBM gets UVM / UVM-caching placements, or a
    `PlannerError` on every rank.
    ``table_optimizers`` (module path -> table -> the optimizer a fused module runs it with)
    size each table's optimizer state; other tables are counted with ``default_optimizer``.
    """
    try:
        from recopt.sharding.planner import (
            EmbeddingShardingPlanner,
            plan_collectively,
            training_topology,
        )
    except ImportError:  # the planner is optional; a balanced table-wise plan always works
        return balanced_table_wise_plan(tables_by_module, world)
    topology = training_topology(world, ranks_per_host, device, process_group, timeout)
    planner = EmbeddingShardingPlanner(topology, default_optimizer=default_optimizer)
    # Planned on rank 0 and broadcast, so every rank holds the same plan.
    return plan_collectively(planner, tables_by_module, process_group, timeout, table_optimizers)
