"""``torchrec.optim.warmup``: recopt's learning-rate warmup."""

from recopt.optim import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = ["WarmupOptimizer", "WarmupPolicy", "WarmupStage"]
