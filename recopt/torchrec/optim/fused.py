"""``torchrec.optim.fused``: recopt's fused-optimizer types."""

from recopt.optim import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

__all__ = ["EmptyFusedOptimizer", "FusedOptimizer", "FusedOptimizerModule"]
