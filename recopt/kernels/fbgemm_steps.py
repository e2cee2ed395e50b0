"""recopt's per-table ``step`` counters before fbgemm's one iteration counter (CUDA Adam, LAMB).

fbgemm's ADAM / PARTIAL_ROWWISE_ADAM / LAMB / PARTIAL_ROWWISE_LAMB keep one counter per kernel
(``iter`` on the device, ``iter_cpu`` on the host), advance it in every forward, and add
``eps`` to the bias-corrected root ``sqrt(v / (1 - beta2^t))``. recopt keeps one ``step`` per
table, advanced by each backward that updates. Before each forward this sets fbgemm's counter
from recopt's; for adam (SparseAdam's ``eps`` on ``sqrt(v)``) it also sets fbgemm's ``eps`` to
``eps / sqrt(1 - beta2^t)``, which makes the two formulas equal (docs/kernels.md, "fbgemm's
CUDA Adam"); recopt's lamb is fbgemm's formula, its ``eps`` passes as is. The backward advances
recopt's counters. Checkpoints hold recopt's counters, so they move between backends. The
kernel passes its counters into each call: `FbgemmSteps` holds no reference to the kernel, so
a dropped kernel (and fbgemm's memory with it) is freed by reference counting, not by a later
``gc.collect()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from recopt.kernels.steps import StepMirror

Tensor = torch.Tensor


def sparse_adam_eps_for_fbgemm(eps: float, beta2: float, step: int) -> float:
    """fbgemm's ``eps`` that makes its step ``step`` equal SparseAdam's with ``eps``.

    fbgemm divides by ``sqrt(v) / sqrt(c) + eps_f`` with ``c = 1 - beta2^step``, SparseAdam
    by ``(sqrt(v) + eps) / sqrt(c)``; they agree when ``eps_f = eps / sqrt(c)``.
    """
    return eps / math.sqrt(1.0 - beta2**step)


def shared_step(values: Sequence[int], table_names: Sequence[str]) -> int:
    """The one counter fbgemm keeps for all the kernel's tables.

    Raises:
        ValueError: the tables' counters differ (e.g. a checkpoint that trained them apart);
            the message names the tables, their steps and the fix.
    """
    if len(set(values)) > 1:
        steps = ", ".join(f"{n!r}: {v}" for n, v in zip(table_names, values, strict=True))
        raise ValueError(
            "fbgemm's Adam and LAMB keep one step counter for all tables of a kernel, but the "
            f"tables' 'step' states differ ({steps}); load equal steps, or run these tables with "
            "backend='recopt' (one counter per table)"
        )
    return values[0] if values else 0


class FbgemmSteps:
    """Keeps fbgemm's iteration counter and ``eps`` in step with recopt's per-table counters.

    Args:
        steps: the tables' 0-dim int64 ``step`` tensors (the checkpointed state), zero now.
        table_names: the tables, for error messages.
        eps: recopt's ``eps`` (SparseAdam's when ``remap_eps``).
        beta2: the second-moment coefficient.
        remap_eps: give fbgemm SparseAdam's ``eps`` for each step (adam); ``False`` leaves
            fbgemm's ``eps`` alone (lamb, whose formula is fbgemm's).
    """

    def __init__(
        self,
        steps: Sequence[Tensor],
        table_names: Sequence[str],
        eps: float,
        beta2: float,
        remap_eps: bool = True,
    ) -> None:
        self._names = list(table_names)
        self._eps = eps
        self._beta2 = beta2
        self._remap_eps = remap_eps
        self._mirror = StepMirror(steps, [0] * len(self._names))

    def before_forward(self, tbe: Any, steps: Sequence[Tensor]) -> int:
        """Set ``tbe``'s counter (and ``eps``) for the step this forward's backward applies.

        fbgemm adds one to its counter in forward and uses the result in backward. Reads the
        counters back only after they were written from outside (a checkpoint load).

        Args:
            tbe: fbgemm's kernel.
            steps: the tables' ``step`` tensors now (a module's ``to()`` may replace them).

        Returns:
            The step the update will use (recopt's counter + 1).
        """
        step = shared_step(self._mirror.values(steps), self._names)
        # Both copies: fbgemm reloads iter_cpu from the device `iter` whenever it is 0 (and
        # builds older than its host copy read `iter` alone).
        tbe.iter.fill_(step)
        if hasattr(tbe, "iter_cpu"):
            tbe.iter_cpu.fill_(step)
        if self._remap_eps:
            eps = sparse_adam_eps_for_fbgemm(self._eps, self._beta2, step + 1)
            tbe.optimizer_args = tbe.optimizer_args._replace(eps=eps)
        return step + 1

    def after_update(self, steps: Sequence[Tensor]) -> None:
        """Advance every table's counter in ``steps`` (device op; the host copy follows
        without a read)."""
        self._mirror.advance(steps)
