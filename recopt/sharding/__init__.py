"""recopt.sharding: sharding plans, sharded embedding modules, and the planner (``planner/``)."""

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

__all__ = [
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
