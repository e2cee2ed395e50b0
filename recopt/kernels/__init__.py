"""Table-batched embedding kernels with the optimizer fused into backward."""

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)
from recopt.kernels.contract import Kernel, KernelHook, flush_kernel_caches
from recopt.kernels.placement import Location, Placement
from recopt.kernels.registry import OPTIMIZERS, OptimizerSpec, StateShape, optimizer_spec

__all__ = [
    "OPTIMIZERS",
    "Backend",
    "FusedOptimizerConfig",
    "Kernel",
    "KernelHook",
    "Location",
    "Placement",
    "OptimizerSpec",
    "PoolingType",
    "StateShape",
    "TableSpec",
    "flush_kernel_caches",
    "optimizer_spec",
    "optimizer_state_floats",
]
