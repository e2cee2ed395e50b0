"""recopt.optim: keyed, combined, warmup, clipping, fused, stub and row-wise Adagrad optimizers."""

from recopt.optim.clipping import GradientClipping, GradientClippingOptimizer
from recopt.optim.combined import CombinedOptimizer
from recopt.optim.fused import (
    EmptyFusedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
    fused_optimizers,
    in_backward_optimizer_filter,
    is_fused,
    split_fused_parameters,
)
from recopt.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from recopt.optim.rowwise_adagrad import RowWiseAdagrad
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
    "RowWiseAdagrad",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "fused_optimizers",
    "in_backward_optimizer_filter",
    "is_fused",
    "lr_multiplier",
    "resolve_stages",
    "split_fused_parameters",
]
