"""``torchrec.distributed``: DistributedModelParallel, sharders, planner and plan types."""

from recopt.torchrec.distributed import (  # noqa: F401
    embedding,
    embedding_types,
    embeddingbag,
    model_parallel,
    planner,
    sharding_plan,
    train_pipeline,
    types,
)
from recopt.torchrec.distributed.model_parallel import DistributedModelParallel
from recopt.torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)

__all__ = [
    "DistributedModelParallel",
    "ModuleSharder",
    "ParameterSharding",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
]
if hasattr(train_pipeline, "TrainPipelineSparseDist"):
    TrainPipelineSparseDist = train_pipeline.TrainPipelineSparseDist
    __all__.append("TrainPipelineSparseDist")
