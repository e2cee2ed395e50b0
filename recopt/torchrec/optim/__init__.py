"""``torchrec.optim``: recopt's keyed, combined, warmup, clipping and row-wise optimizers."""

from recopt.optim import (
    CombinedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
    GradientClipping,
    GradientClippingOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
    RowWiseAdagrad,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
)
from recopt.torchrec.optim import clipping, fused, keyed, optimizers, rowwise_adagrad, warmup
from recopt.torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recopt.torchrec.optim.optimizers import SGD, Adagrad, Adam

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "CombinedOptimizer",
    "FusedOptimizer",
    "FusedOptimizerModule",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RowWiseAdagrad",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "apply_optimizer_in_backward",
    "clipping",
    "fused",
    "keyed",
    "optimizers",
    "rowwise_adagrad",
    "warmup",
]
