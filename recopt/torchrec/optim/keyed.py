"""``torchrec.optim.keyed``: recopt's keyed optimizers."""

from recopt.optim import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper

__all__ = ["CombinedOptimizer", "KeyedOptimizer", "KeyedOptimizerWrapper", "OptimizerWrapper"]
