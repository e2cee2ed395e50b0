"""recopt.optim: keyed, combined, warmup, clipping, fused and stub optimizers."""

from recopt.optim.combined import CombinedOptimizer
from recopt.optim.fused import (
    EmptyFusedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
    fused_optimizers,
    split_fused_parameters,
)
from recopt.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper

__all__ = [
    "CombinedOptimizer",
    "EmptyFusedOptimizer",
    "FusedOptimizer",
    "FusedOptimizerModule",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "fused_optimizers",
    "split_fused_parameters",
]
