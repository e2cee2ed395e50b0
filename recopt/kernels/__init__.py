"""Table-batched embedding kernels with the optimizer fused into backward."""

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)

__all__ = [
    "Backend",
    "FusedOptimizerConfig",
    "PoolingType",
    "TableSpec",
    "optimizer_state_floats",
]
