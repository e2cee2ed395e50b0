"""RowWiseAdagrad: Adagrad with one accumulator per row (per first-dim slice) of a parameter.

The dense (torch.optim) twin of the fused ``row_wise_adagrad`` kernel, for embedding
tables trained outside the fused path: each row's accumulator grows by the mean of its
squared gradient, so a ``[rows, dim]`` table keeps ``rows`` floats of state, not ``rows x dim``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad: ``sum[r] += mean(g[r]^2)``; ``p[r] -= lr_t * g[r] / (sqrt(sum[r]) + eps)``.

    ``lr_t = lr / (1 + (step - 1) * lr_decay)``; weight decay adds ``weight_decay * p`` to the
    gradient first. A 1-D parameter has one row per element (its accumulator is plain
    Adagrad's). With equal rows of gradient values it equals ``torch.optim.Adagrad``.

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0).
        lr_decay: learning-rate decay (>= 0).
        weight_decay: L2 penalty (>= 0).
        initial_accumulator_value: start of every row's accumulator (>= 0).
        eps: added to the denominator (>= 0).
        maximize: ascend instead of descend.

    Raises:
        ValueError: a negative hyperparameter, naming it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        maximize: bool = False,
    ) -> None:
        values = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
        }
        for name, value in values.items():
            if not value >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name}={value} must be >= 0")
        super().__init__(params, {**values, "maximize": maximize})

    def _state_of(self, p: torch.Tensor, initial: float) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            rows = p.shape[0] if p.dim() > 0 else 1
            state["step"] = torch.tensor(0.0)
            state["sum"] = torch.full((rows,), initial, dtype=p.dtype, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One update of every parameter with a gradient.

        Raises:
            ValueError: a sparse gradient (use the fused ``row_wise_adagrad`` kernel).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(
                        "RowWiseAdagrad takes dense gradients; for sparse ones use the fused "
                        "row_wise_adagrad optimizer (FusedEmbeddingBagCollection)"
                    )
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        assert p.grad is not None
        grad = -p.grad if group["maximize"] else p.grad
        state = self._state_of(p, group["initial_accumulator_value"])
        state["step"] += 1
        if group["weight_decay"]:
            grad = grad + group["weight_decay"] * p
        rows_R_C = grad.reshape(state["sum"].numel(), -1)
        state["sum"].add_(rows_R_C.square().mean(dim=1))
        lr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
        denom_R_1 = state["sum"].sqrt().add_(group["eps"]).unsqueeze(1)
        p.add_((rows_R_C / denom_R_1).view_as(p), alpha=-lr)
