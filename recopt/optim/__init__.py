"""recopt.optim: keyed, combined, warmup, clipping, fused and stub optimizers."""

from recopt.optim.fused import FusedOptimizer, FusedOptimizerModule
from recopt.optim.keyed import KeyedOptimizer

__all__ = ["FusedOptimizer", "FusedOptimizerModule", "KeyedOptimizer"]
