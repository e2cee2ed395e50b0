"""``torchrec.distributed.planner.EmbeddingShardingPlanner``: TorchRec's signature over recopt's
planner: ``plan(module, sharders)`` plans on this rank, ``collective_plan(module, sharders,
pg)`` on rank 0 of ``pg`` and broadcasts the plan (recopt's `plan_collectively`)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recopt.sharding import ShardingPlan
from recopt.sharding.planner import EmbeddingShardingPlanner as _RecoptPlanner
from recopt.sharding.planner import PlanStats, plan_collectively
from recopt.sharding.planner import Topology as _RecoptTopology
from recopt.torchrec.distributed._tables import table_optimizers, tables_by_module
from recopt.torchrec.distributed.planner.types import Topology
from recopt.torchrec.distributed.types import ModuleSharder

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def _default_topology() -> _RecoptTopology:
    """TorchRec's default: the world's size, CUDA when available."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Topology(world, "cuda" if torch.cuda.is_available() else "cpu")


class EmbeddingShardingPlanner:
    """Plans the sharding of every embedding collection of a module.

    Args:
        topology: recopt's `Topology` (``planner.types.Topology(world_size, compute_device,
            ...)`` builds one); default: the world's ranks on CUDA if available, else CPU.
        batch_size: bags per feature per rank in one step (default 512, TorchRec's).
        constraints: table name -> `ParameterConstraints` (TorchRec's or recopt's).
        debug: accepted (recopt's statistics are on ``planner.stats``).
        timeout_seconds: limit of each broadcast in `collective_plan` (default 300 s).
        Others (``enumerator``, ``proposer``, ``partitioner``, ...): only None; recopt's
        planner stages are not exchangeable.

    Raises:
        ValueError: a pluggable stage was given (naming it).
    """

    def __init__(
        self,
        topology: _RecoptTopology | None = None,
        batch_size: int | None = None,
        constraints: Mapping[str, Any] | None = None,
        debug: bool = True,
        timeout_seconds: int | None = None,
        **stages: Any,
    ) -> None:
        given = sorted(name for name, value in stages.items() if value is not None)
        if given:
            raise ValueError(
                f"EmbeddingShardingPlanner: {given} cannot be replaced in recopt's planner; "
                "pass topology, batch_size and constraints only"
            )
        recopt_constraints = {
            name: c.to_recopt() if hasattr(c, "to_recopt") else c
            for name, c in (constraints or {}).items()
        }
        self._planner = _RecoptPlanner(
            topology or _default_topology(), recopt_constraints, batch_size or 512
        )
        self._timeout = (
            DEFAULT_TIMEOUT
            if timeout_seconds is None
            else datetime.timedelta(seconds=timeout_seconds)
        )
        self.debug = debug

    @property
    def topology(self) -> _RecoptTopology:
        return self._planner.topology

    @property
    def stats(self) -> PlanStats | None:
        """The last plan's estimates (recopt's `PlanStats`)."""
        return self._planner.stats

    def plan(self, module: nn.Module, sharders: Sequence[ModuleSharder]) -> ShardingPlan:
        """The plan of ``module``'s embedding collections, computed on this rank.

        Raises:
            PlannerError: a table fits nowhere or its constraints leave no option.
        """
        return self._planner.plan(tables_by_module(module), table_optimizers(module, sharders))

    def collective_plan(
        self,
        module: nn.Module,
        sharders: Sequence[ModuleSharder] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """The plan computed on rank 0 of ``pg`` (default: the world), the same on every rank.

        Raises:
            PlannerError: planning failed on rank 0 (raised on every rank), or the topology's
                world size differs from the group's.
        """
        return plan_collectively(
            self._planner,
            tables_by_module(module),
            pg,
            self._timeout,
            table_optimizers(module, sharders),
        )
