"""Table-batched embedding kernels with the optimizer fused into backward."""

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)
from recopt.kernels.contract import Kernel, KernelHook
from recopt.kernels.registry import OPTIMIZERS, OptimizerSpec, StateShape, optimizer_spec

__all__ = [
    "OPTIMIZERS",
    "Backend",
    "FusedOptimizerConfig",
    "Kernel",
    "KernelHook",
    "OptimizerSpec",
    "PoolingType",
    "StateShape",
    "TableSpec",
    "optimizer_spec",
    "optimizer_state_floats",
]
