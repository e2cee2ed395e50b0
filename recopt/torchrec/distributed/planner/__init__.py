"""``torchrec.distributed.planner``: the planner, its topology and constraints."""

from recopt.torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from recopt.torchrec.distributed.planner.types import ParameterConstraints, Topology

__all__ = ["EmbeddingShardingPlanner", "ParameterConstraints", "Topology"]
