"""recopt.sharding: sharding plans, sharded embedding modules, and the planner (``planner/``)."""

from recopt.kernels.placement import Location, Placement
from recopt.sharding.input_dist import RemoteInputError
from recopt.sharding.model_parallel import DistributedModelParallel
from recopt.sharding.plan import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingType,
    ShardSpec,
    TableLike,
)
from recopt.sharding.plan_helpers import (
    ShardingRequest,
    balanced_table_wise_plan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    split_columns,
    split_evenly,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recopt.sharding.plan_validation import validate_plan
from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection
from recopt.sharding.state import full_tensor
from recopt.sharding.train_pipeline import (
    EvalPipelineSparseDist,
    TrainedPosition,
    TrainPipelineSparseDist,
)

__all__ = [
    "DistributedModelParallel",
    "EvalPipelineSparseDist",
    "TrainPipelineSparseDist",
    "TrainedPosition",
    "RemoteInputError",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "full_tensor",
    "Location",
    "Placement",
    "ParameterSharding",
    "PlanError",
    "ShardSpec",
    "ShardingPlan",
    "ShardingRequest",
    "ShardingType",
    "TableLike",
    "balanced_table_wise_plan",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "row_wise",
    "split_columns",
    "split_evenly",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_plan",
]
