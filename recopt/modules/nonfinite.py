"""Stop a NaN/inf output gradient before a fused kernel updates its tables in backward.

Fused kernels update weights and optimizer state inside their own backward, so the check must
come first: the kernels run detached from the caller's graph, and their backward is called only
when the gradient of their pooled output is finite (one host read per step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor


class NonFiniteGradGuard:
    """Counts the steps whose fused update was skipped for a NaN/inf gradient; warns once.

    Attributes:
        skipped_steps: backward passes whose gradient was not finite (no table was updated).
    """

    def __init__(self, owner: str) -> None:
        self.skipped_steps = 0
        self._owner = owner
        self._warned = False

    def admit(self, grad: Tensor) -> bool:
        """Whether ``grad`` is finite; counts (and warns once) when it is not."""
        if grad.numel() == 0:
            return True
        # min and max propagate NaN and hold any inf; ~15x cheaper on CPU than isfinite(grad)
        # .all(), which materialises a flag per element.
        low_high = torch.stack(torch.aminmax(grad))
        if bool(torch.isfinite(low_high).all()):  # the one host read of the guard
            return True
        self.skipped_steps += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._owner}: the gradient of the pooled embeddings holds NaN or inf; the "
                "fused update of this step was skipped (no weight or optimizer state changed). "
                "Further skips are counted in skipped_nonfinite_steps without a warning.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False


def guarded_lookup(
    lookup: Callable[[Tensor | None], Tensor],
    guard: NonFiniteGradGuard,
    weights: Tensor | None,
    device: torch.device,
) -> Tensor:
    """Run ``lookup(weights)`` (the kernels' forward) so its backward runs only on finite grads.

    Args:
        lookup: calls the kernels with the given per-id weights; returns the pooled output.
        guard: decides and counts.
        weights: the per-id weights, or ``None``; their gradient still flows when admitted.
        device: where a zero-size tensor anchoring the gate in the graph is made.

    Returns:
        The pooled output; without grad mode, ``lookup(weights)`` itself.
    """
    if not torch.is_grad_enabled():
        return lookup(weights)
    anchor = torch.empty(0, device=device, requires_grad=True)
    out: Tensor = _SkipNonFiniteUpdate.apply(lookup, guard, anchor, weights)
    return out


class _SkipNonFiniteUpdate(torch.autograd.Function):
    """Forward: the kernels on a private graph. Backward: that graph only if the grad is finite."""

    @staticmethod
    def forward(
        ctx: Any,
        lookup: Callable[[Tensor | None], Tensor],
        guard: NonFiniteGradGuard,
        anchor: Tensor,
        weights: Tensor | None,
    ) -> Tensor:
        leaf = None
        if weights is not None:
            leaf = weights.detach().requires_grad_(weights.requires_grad)
        with torch.enable_grad():
            out = lookup(leaf)
        ctx.inner = (out, leaf)
        ctx.guard = guard
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out, leaf = ctx.inner  # a second backward (retain_graph) finds the kernels' graph freed
        guard: NonFiniteGradGuard = ctx.guard
        grad = grad.contiguous()  # once, for the check and the kernels (which need it anyway)
        if not guard.admit(grad) or not out.requires_grad:
            return None, None, None, None
        # Runs the kernels' backward, i.e. their fused updates (a nested backward confined to
        # the kernels' graph: its only leaves are the tables and the detached weights).
        torch.autograd.backward(out, grad)
        grad_weights = None if leaf is None or not leaf.requires_grad else leaf.grad
        return None, None, None, grad_weights
