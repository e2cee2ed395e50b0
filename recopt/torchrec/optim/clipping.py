"""``torchrec.optim.clipping``: recopt's gradient clipping."""

from recopt.optim import GradientClipping, GradientClippingOptimizer

__all__ = ["GradientClipping", "GradientClippingOptimizer"]
