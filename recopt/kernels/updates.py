"""Row updates of the fused embedding optimizers, in plain vectorised torch.

Each update reads and writes only the rows of one table that the batch touched: it gets the
sorted unique row ids and their aggregated gradients. This is recopt's portable path (any
device, any float dtype); `cpu_fused` runs the same formulas in one fused native pass.
fp16/bf16 tables and state go through `apply_update_rounded`: fp32 copies of the touched
rows are updated, then stochastically rounded back (recopt.kernels.precision).
Legend: R rows of the table, D its dim, U unique rows touched by the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recopt.kernels import registry
from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.precision import stochastic_round

Tensor = torch.Tensor

# (sum of squared gradients over this table's columns [U]) -> mean over the full row [U].
RowStat = Callable[[Tensor], Tensor]


def _row_mean_sq(grad_U_D: Tensor, row_stat: RowStat | None) -> Tensor:
    """Mean squared gradient per row; over the full row when columns live elsewhere too."""
    if row_stat is None:
        return grad_U_D.square().mean(dim=1)
    return row_stat(grad_U_D.square().sum(dim=1))


def init_state(
    name: str, rows: int, dim: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Zero optimizer state of one table, with the contract's names and shapes.

    Args:
        name: fused optimizer name.
        rows: rows of the table.
        dim: embedding dim of the table.
        device: where the state lives.
        dtype: the state's dtype (``FusedOptimizerConfig.state_dtype``).

    Returns:
        State name -> tensor (``dtype`` state, int64 0-dim ``step``).

    Raises:
        ValueError: unknown optimizer name.
    """
    spec = registry.optimizer_spec(name)
    state = {
        key: torch.zeros(shape.size(rows, dim), dtype=dtype, device=device)
        for key, shape in spec.states
    }
    if spec.stepped:
        state["step"] = torch.zeros((), dtype=torch.int64, device=device)
    return state


@dataclass(slots=True)
class AdafactorNorm:
    """Running sum of squares of a table's weights, for Adafactor's parameter scale.

    Recomputed from the weights whenever they were written outside the optimizer (the
    tensor's version counter moved); otherwise kept up to date from the touched rows only,
    so a step never reads the whole table.
    """

    sum_sq: float = 0.0
    version: int = -1


def _l2_and_sign(config: FusedOptimizerConfig, weight_U_D: Tensor, grad_U_D: Tensor) -> Tensor:
    """The gradient after ``maximize`` (negation) and L2 weight decay on the touched rows."""
    grad = -grad_U_D if config.maximize else grad_U_D
    if config.weight_decay != 0.0:
        grad = grad + config.weight_decay * weight_U_D
    return grad


def _adam_like(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
) -> None:
    """Adam (SparseAdam's formulas) and row-wise Adam on the touched rows."""
    beta1, beta2 = config.betas
    eps = config.eps1 if config.eps1 is not None else 1e-8
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    step = int(state["step"].item())
    m_U_D = exp_avg.index_select(0, rows_U)
    m_U_D.add_(grad_U_D.sub(m_U_D).mul_(1.0 - beta1))
    exp_avg.index_copy_(0, rows_U, m_U_D)
    if exp_avg_sq.dim() == 2:
        v_U_D = exp_avg_sq.index_select(0, rows_U)
        v_U_D.add_(grad_U_D.square().sub_(v_U_D).mul_(1.0 - beta2))
        exp_avg_sq.index_copy_(0, rows_U, v_U_D)
        denom = v_U_D.sqrt().add_(eps)
    else:
        v_U = exp_avg_sq.index_select(0, rows_U)
        v_U.add_(_row_mean_sq(grad_U_D, row_stat).sub_(v_U).mul_(1.0 - beta2))
        exp_avg_sq.index_copy_(0, rows_U, v_U)
        denom = v_U.sqrt().add_(eps).unsqueeze(1)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    weight.index_add_(0, rows_U, m_U_D.div_(denom).mul_(-step_size))


def _sum_sq(x_R_D: Tensor) -> float:
    """Sum of squares in float64 without a full-size temporary: row norms, then their sum."""
    if x_R_D.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(x_R_D, dim=1).double().square().sum().item())


def _adafactor(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    norm: AdafactorNorm,
) -> None:
    """torch.optim.Adafactor on the dense gradient whose absent rows are zero.

    Exactly that, except decoupled weight decay, which only shrinks the touched rows.
    """
    rows, dim = weight.shape
    grad = -grad_U_D if config.maximize else grad_U_D
    eps1 = config.eps1 if config.eps1 is not None else torch.finfo(weight.dtype).eps
    step = float(state["step"].item())
    beta2_t = step**config.beta2_decay
    rho = min(lr, 1.0 / math.sqrt(step))
    if norm.version != weight._version:
        norm.sum_sq = _sum_sq(weight)
    alpha = max(config.eps2, math.sqrt(norm.sum_sq / weight.numel())) * rho
    w_U_D = weight.index_select(0, rows_U)
    old_sum_sq = _sum_sq(w_U_D)
    if config.weight_decay != 0.0:
        w_U_D.mul_(1.0 - lr * config.weight_decay)
    # Absent rows have a zero gradient: their row statistic decays, nothing else changes.
    row_var, col_var = state["row_var"], state["col_var"]
    row_var.mul_(1.0 - beta2_t)
    grad_sq_U_D = grad.square()
    row_var.index_add_(0, rows_U, grad_sq_U_D.mean(dim=1).mul_(beta2_t))
    col_var.lerp_(grad_sq_U_D.sum(dim=0).div_(rows), beta2_t)
    del grad_sq_U_D
    row_scale = row_var.mean().clamp(min=eps1)
    var_U_D = torch.outer(row_var.index_select(0, rows_U), col_var).div_(row_scale)
    update_U_D = var_U_D.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
    clip = max(
        1.0, float(update_U_D.norm().item()) / (math.sqrt(rows * dim) * config.clip_threshold)
    )
    w_U_D.add_(update_U_D, alpha=-alpha / clip)
    weight.index_copy_(0, rows_U, w_U_D)
    norm.sum_sq += _sum_sq(w_U_D) - old_sum_sq
    norm.version = weight._version


def _sgd(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
) -> None:
    """Plain SGD on the touched rows."""
    weight.index_add_(0, rows_U, grad_U_D, alpha=-lr)


def _adagrad(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
) -> None:
    """Adagrad (per element) and row-wise Adagrad (one statistic per row)."""
    eps = config.eps1 if config.eps1 is not None else 1e-8
    momentum = state["momentum1"]
    if momentum.dim() == 2:
        m_U_D = momentum.index_select(0, rows_U).add_(grad_U_D.square())
        momentum.index_copy_(0, rows_U, m_U_D)
        weight.index_add_(0, rows_U, grad_U_D.div(m_U_D.sqrt_().add_(eps)), alpha=-lr)
        return
    m_U = momentum.index_select(0, rows_U).add_(_row_mean_sq(grad_U_D, row_stat))
    momentum.index_copy_(0, rows_U, m_U)
    weight.index_add_(0, rows_U, grad_U_D.div(m_U.sqrt_().add_(eps).unsqueeze(1)), alpha=-lr)


def apply_update(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    norm: AdafactorNorm | None = None,
    row_stat: RowStat | None = None,
) -> None:
    """Apply one optimizer step to the touched rows of one table, in place.

    The step counter (if any) must already have been advanced for this step.

    Args:
        config: the fused optimizer and its hyperparameters.
        lr: the learning rate for this step.
        weight: ``[R, D]`` table weights, updated in place.
        state: the table's optimizer state (see `init_state`), updated in place.
        rows_U: sorted unique row ids touched by the batch.
        grad_U_D: gradient of each touched row, summed over its occurrences.
        norm: Adafactor's running weight norm (required for ``adafactor``).
        row_stat: for row-wise optimizers of a column shard: maps the per-row sum of squared
            gradients over this shard's columns to the mean over the full row.

    Raises:
        ValueError: ``adafactor`` without ``norm``.
    """
    update = _UPDATES[config.name]
    if update is _adafactor:
        if norm is None:
            raise ValueError("apply_update: adafactor needs its AdafactorNorm; pass norm=")
        _adafactor(config, lr, weight, state, rows_U, grad_U_D, norm)
        return
    if rows_U.numel() == 0:
        return
    w_U_D = weight.index_select(0, rows_U)
    grad = _l2_and_sign(config, w_U_D, grad_U_D)
    update(config, lr, weight, state, rows_U, grad, row_stat)


def apply_update_rounded(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    generator: torch.Generator | None,
    row_stat: RowStat | None = None,
) -> None:
    """`apply_update` for fp16/bf16 weights or state: computed in fp32, rounded back.

    The touched rows of the weights and of every per-row state are copied to fp32 (a compact
    ``[U, ...]`` table), updated there by the optimizer's own rule, and written back with
    `stochastic_round` (``generator``), or rounded to nearest when ``generator`` is None.
    Per-table scalars (``step``) are used as they are. Not for optimizers whose state is not
    indexed by row (adafactor: refused at construction).
    """
    if rows_U.numel() == 0:
        return
    rows = weight.shape[0]
    local_U = torch.arange(rows_U.numel(), device=rows_U.device)
    weight_U_D = weight.index_select(0, rows_U).float()
    state_U = {
        key: value.index_select(0, rows_U).float() if value.dim() > 0 else value
        for key, value in state.items()
    }
    assert all(v.dim() == 0 or v.shape[0] == rows for v in state.values())
    apply_update(config, lr, weight_U_D, state_U, local_U, grad_U_D.float(), None, row_stat)

    def write(target: Tensor, value: Tensor) -> None:
        if generator is None:
            rounded = value.to(target.dtype)
        else:
            rounded = stochastic_round(value, target.dtype, generator)
        target.index_copy_(0, rows_U, rounded)

    write(weight, weight_U_D)
    for key, value in state.items():
        if value.dim() > 0:
            write(value, state_U[key])


# The update rule of each optimizer in the registry (adafactor also takes its norm).
_UPDATES: dict[str, Callable[..., None]] = {
    registry.SGD.name: _sgd,
    registry.ADAGRAD.name: _adagrad,
    registry.ROW_WISE_ADAGRAD.name: _adagrad,
    registry.ADAM.name: _adam_like,
    registry.ROW_WISE_ADAM.name: _adam_like,
    registry.ADAFACTOR.name: _adafactor,
}
