"""NaN/inf gradients under fault tolerance: a step that saw one is dropped on every replica.

The checks run on data every replica holds identically (gathered row gradients, the averaged
dense gradient), so all replicas report the error, vote no, and skip the same collectives.
"""

from __future__ import annotations

from typing import Protocol

import torch

from recopt.modules.nonfinite import finite_flag


class NonFiniteGradientError(RuntimeError):
    """A gradient of some replica held NaN or inf: the step is dropped on every replica."""


class _ErrorSink(Protocol):
    def report_error(self, exc: Exception) -> None: ...


def nonfinite_rows(tensors: list[torch.Tensor]) -> list[int]:
    """Indices of the tensors holding NaN or inf (one host read for all of them)."""
    if not tensors:
        return []
    finite = torch.stack([finite_flag([t], t.device) for t in tensors]).tolist()
    return [i for i, ok in enumerate(finite) if not ok]


def report_nonfinite(manager: _ErrorSink, all_grads: list[torch.Tensor], where: str) -> bool:
    """Report NaN/inf in any replica's row gradients to ``manager``; True if it did.

    Args:
        manager: the replica group's manager (its step is then dropped everywhere).
        all_grads: every replica's gradients, in quorum rank order (the same on all).
        where: names the kernel and table in the message.
    """
    bad = nonfinite_rows(all_grads)
    if bad:
        manager.report_error(
            NonFiniteGradientError(
                f"{where}: the row gradients of quorum rank(s) {bad} hold NaN or inf; the "
                "step is dropped on every replica and its fused updates rolled back"
            )
        )
    return bool(bad)
