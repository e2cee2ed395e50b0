"""The sharding planner: topology and constraints in, a `ShardingPlan` and its estimates out.

Stages, one file each: topology, constraints, enumerator, storage and perf (estimators),
proposers, partitioner, planner (the driver), stats; cli and calibrate are `recopt-plan`.
"""

from recopt.sharding.planner.constraints import ConstraintError, ParameterConstraints
from recopt.sharding.planner.planner import (
    EmbeddingShardingPlanner,
    PlannerError,
    plan_collectively,
    shared_topology,
    training_topology,
)
from recopt.sharding.planner.stats import PlanStats, TableChoice, evaluate_plan
from recopt.sharding.planner.topology import (
    Topology,
    TopologyError,
    cuda_memory_bytes,
    local_topology,
)

__all__ = [
    "ConstraintError",
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "PlanStats",
    "PlannerError",
    "TableChoice",
    "Topology",
    "TopologyError",
    "cuda_memory_bytes",
    "evaluate_plan",
    "local_topology",
    "plan_collectively",
    "shared_topology",
    "training_topology",
]
