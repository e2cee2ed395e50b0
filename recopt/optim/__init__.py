"""recopt.optim: keyed, combined, warmup, clipping, fused and stub optimizers."""

from recopt.optim.clipping import GradientClipping, GradientClippingOptimizer
from recopt.optim.combined import CombinedOptimizer
from recopt.optim.fused import (
    EmptyFusedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
    fused_optimizers,
    is_fused,
    split_fused_parameters,
)
from recopt.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from recopt.optim.stub import OptimizerStub
from recopt.optim.warmup import (
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
    lr_multiplier,
    resolve_stages,
)

__all__ = [
    "CombinedOptimizer",
    "EmptyFusedOptimizer",
    "FusedOptimizer",
    "FusedOptimizerModule",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerStub",
    "OptimizerWrapper",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "fused_optimizers",
    "is_fused",
    "lr_multiplier",
    "resolve_stages",
    "split_fused_parameters",
]
