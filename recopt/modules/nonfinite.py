"""Stop a NaN/inf output gradient before a fused kernel updates its tables in backward.

Fused kernels update weights and optimizer state inside their own backward, so the check must
come first: the kernels run detached from the caller's graph, and their backward is called only
when the gradient of their pooled output is finite (one host read per step). The sharded twin
decides elsewhere (every rank must agree) and uses `backward_if_given`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

Tensor = torch.Tensor


class NonFiniteGradGuard:
    """Counts the steps whose fused update was skipped for a NaN/inf gradient; warns once.

    Attributes:
        skipped_steps: backward passes whose gradient was not finite (no table was updated).
    """

    def __init__(self, owner: str, scope: str = "") -> None:
        self.skipped_steps = 0
        self._owner = owner
        self._scope = scope  # where the bad values may be, e.g. " (on this rank or another)"
        self._warned = False

    def admit(self, grad: Tensor) -> bool:
        """Whether ``grad`` is finite; counts (and warns once) when it is not."""
        if grad.numel() == 0:
            return True
        return self.record(bool(finite_flag([grad], grad.device)))  # the guard's one host read

    def record(self, finite: bool) -> bool:
        """Count a step decided elsewhere (``finite`` False: skipped); returns ``finite``."""
        if finite:
            return True
        self.skipped_steps += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._owner}: the gradient of the pooled embeddings holds NaN or inf"
                f"{self._scope}; the fused update of this step was skipped (no weight or "
                "optimizer state changed). Further skips are counted in "
                "skipped_nonfinite_steps without a warning.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False


def finite_flag(grads: Sequence[Tensor | None], device: torch.device) -> Tensor:
    """A 0-dim bool tensor on ``device``: every value of ``grads`` is finite (no host read).

    min and max propagate NaN and hold any inf; ~15x cheaper on CPU than isfinite(grad).all(),
    which materialises a flag per element. Nothing the size of a gradient is allocated, also
    for a strided one (`_min_max`).
    """
    parts = [_min_max(g).float() for g in grads if g is not None and g.numel()]
    if not parts:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.cat(parts)).all()


def _min_max(grad: Tensor) -> Tensor:
    """``[min, max]`` of ``grad``, without copying a broadcast or permuted gradient.

    The full-tensor ``aminmax`` (and ``min``, ``max``) first make their input contiguous, and
    the gradients reaching a gate often are not: ``loss = out.sum()`` expands one value over
    the whole output (stride 0), a row-wise sharded output's gradient can be one block
    repeated per rank. That copy, the size of the gradient, is a fresh allocation every step,
    which for a large one means fresh pages (page faults; part of what the gate once cost a
    sharded row-wise step: benchmarks/README.md, "Non-finite gradient gate"). Repeats hold no
    new value, so a broadcast dimension is read once, and a permuted layout is read in memory
    order; only a layout with gaps (a strided slice) is still copied.
    """
    for d in range(grad.dim()):
        if grad.stride(d) == 0 and grad.size(d) > 1:
            grad = grad.narrow(d, 0, 1)
    if not grad.is_contiguous():
        order = sorted(range(grad.dim()), key=lambda d: grad.stride(d), reverse=True)
        grad = grad.permute(order)
    return torch.stack(torch.aminmax(grad))


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


def backward_if_given(run: Callable[[], tuple[Tensor, ...]], anchor: Tensor) -> tuple[Tensor, ...]:
    """Run ``run()`` (kernels' forward) on a private graph whose backward runs only if asked.

    The caller decides: when every gradient reaching the outputs is None (the caller's backward
    returned None for them, e.g. because the ranks agreed to skip the step), the kernels'
    backward, and so their fused update, does not run; otherwise it runs with the given
    gradients (a None among given ones counts as zeros).

    Args:
        run: returns the kernels' outputs.
        anchor: a tensor requiring grad, so that the outputs do too.

    Returns:
        ``run()``'s outputs, detached from the private graph.
    """
    outs: tuple[Tensor, ...] = _BackwardIfGiven.apply(run, anchor)
    return outs


class _BackwardIfGiven(torch.autograd.Function):
    """Forward: ``run()`` on a private graph. Backward: that graph, unless no grad is given."""

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[], tuple[Tensor, ...]], anchor: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # None must stay None: it means "skip"
        with torch.enable_grad():
            outs = run()
        ctx.inner = outs
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, None]:
        outs: tuple[Tensor, ...] = ctx.inner
        ctx.inner = ()  # free the kernels' graph (a second backward finds nothing to run)
        if all(g is None for g in grads):
            return None, None
        pairs = [
            (o, torch.zeros_like(o) if g is None else g)
            for o, g in zip(outs, grads, strict=True)
            if o.requires_grad
        ]
        if pairs:  # runs the kernels' backward, i.e. their fused updates
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None
