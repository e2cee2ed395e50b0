"""The DLRM example's watch on NaN/inf steps: count them, and stop after too many in a row.

A step is non-finite when a guard skipped it: a fused collection's gate (its output gradient
held NaN/inf; the sharded one decides for all ranks), gradient clipping's check of the global
norm, or, under fault tolerance, the vote that dropped the step for a NaN/inf gradient. Every
rank (and replica group) sees the same answer, so all of them stop at the same step.
"""

from __future__ import annotations

import torch
from torch import nn

from recopt.ft.nonfinite import NonFiniteGradientError


class NonFiniteTrainingError(RuntimeError):
    """``training.max_consecutive_nonfinite`` steps in a row had a NaN/inf loss or gradient."""


class NonFiniteSteps:
    """Counts skipped (NaN/inf) steps from the guards' counters; raises after ``limit`` in a row.

    Args:
        model: the trained model (its fused or sharded collections count their skips).
        optimizer: the clipping optimizer (``num_skipped_steps``), or anything without it.
        limit: ``training.max_consecutive_nonfinite`` (0: never stop).
        learning_rates: ``(name, value)`` pairs quoted in the error as the likely cause.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: object,
        limit: int,
        learning_rates: list[tuple[str, float]],
    ) -> None:
        # The modules that count skipped steps (the model is built: the set is fixed).
        self._counting = [m for m in model.modules() if hasattr(m, "skipped_nonfinite_steps")]
        self._optimizer = optimizer
        self._limit = limit
        self._lrs = learning_rates
        self._before = self._counters()
        self.total = 0  # skipped steps of this run
        self.in_a_row = 0

    def _counters(self) -> tuple[int, ...]:
        counts = [int(m.skipped_nonfinite_steps) for m in self._counting]
        counts.append(int(getattr(self._optimizer, "num_skipped_steps", 0)))
        return tuple(counts)

    def step_done(self, step: int, ft_error: BaseException | None = None) -> bool:
        """Account for the step just run; returns whether it was skipped as non-finite.

        Args:
            step: its number (for the error message).
            ft_error: under fault tolerance, the manager's error of the step, if any.

        Raises:
            NonFiniteTrainingError: the limit of skipped steps in a row was reached.
        """
        now = self._counters()
        skipped = now != self._before or isinstance(ft_error, NonFiniteGradientError)
        self._before = now
        if not skipped:
            self.in_a_row = 0
            return False
        self.total += 1
        self.in_a_row += 1
        if self._limit and self.in_a_row >= self._limit:
            lrs = ", ".join(f"{name} {value:g}" for name, value in self._lrs)
            raise NonFiniteTrainingError(
                f"{self.in_a_row} training steps in a row (the last at step {step}) had a NaN or "
                f"inf loss or gradient and were skipped (training.max_consecutive_nonfinite = "
                f"{self._limit}); the model stopped learning. Nothing was updated in those "
                "steps, and the newest finite checkpoint is kept. Likely cause: a learning rate "
                f"too high ({lrs}) or bad input values; lower the rate, check the data, or "
                "raise training.max_consecutive_nonfinite (0 never stops)"
            )
        return True


def poison_if_nonfinite(loss: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``loss``, or ``loss * nan`` when it or the dense input holds NaN/inf.

    A NaN in one sample's dense input need not reach the loss or the embedding gradients
    (a fused ReLU maps it to 0), yet it makes the first dense layer's gradient NaN: clipping
    then skips the dense step while the fused tables, updated in backward, would step. Scaled
    by NaN, every gradient of the step is NaN: the fused gate skips the tables on every rank
    (it decides for all), clipping skips the dense step. No host read: the factor is chosen
    on the device.
    """
    finite = torch.isfinite(loss.detach()) & torch.isfinite(dense).all()
    return loss * torch.where(finite, 1.0, float("nan")).to(loss.dtype)
