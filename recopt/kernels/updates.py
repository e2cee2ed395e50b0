"""Row updates of the fused embedding optimizers, in plain vectorised torch.

Each update reads and writes only the rows of one table that the batch touched: it gets the
sorted unique row ids and their aggregated gradients. This is recopt's portable path (any
device, any float dtype); `cpu_fused` runs the same formulas in one fused native pass.
Here fp16/bf16 tables and state go through `apply_update_rounded`: fp32 copies of the touched
rows are updated, then rounded back, stochastically or to nearest (recopt.kernels.precision);
tables rounded stochastically count their passes in a ``rounding_step`` state
(`has_rounding_step`).
Legend: R rows of the table, D its dim, U unique rows touched by the batch.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch

from recopt.kernels import registry
from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.contract import RowUpdate, TableUpdate
from recopt.kernels.precision import Precision, stochastic_round

Tensor = torch.Tensor

# (sum of squared gradients over this table's columns [U]) -> mean over the full row [U].
RowStat = Callable[[Tensor], Tensor]


def _row_mean_sq(grad_U_D: Tensor, row_stat: RowStat | None) -> Tensor:
    """Mean squared gradient per row; over the full row when columns live elsewhere too."""
    if row_stat is None:
        return grad_U_D.square().mean(dim=1)
    return row_stat(grad_U_D.square().sum(dim=1))


# The per-table count of stochastically rounded passes (0-dim int64), checkpointed like
# ``step``: the rounding randomness of pass n is a function of the kernel's seed and n.
ROUNDING_STEP = "rounding_step"


def has_rounding_step(optimizer: FusedOptimizerConfig, weight_dtype: Precision | str) -> bool:
    """Whether a table keeps a ``rounding_step`` counter: its updates are rounded
    stochastically into fp16/bf16 weights or state. A function of the configuration only, so
    every backend and every rank agree on the state keys (fbgemm keeps the counter too, but
    its CUDA kernels round with their own stream)."""
    reduced = optimizer.state_dtype.reduced or Precision(weight_dtype).reduced
    return reduced and optimizer.stochastic_rounding


def init_state(
    name: str,
    rows: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    rounding_step: bool = False,
) -> dict[str, Tensor]:
    """Zero optimizer state of one table, with the contract's names and shapes.

    Args:
        name: fused optimizer name.
        rows: rows of the table.
        dim: embedding dim of the table.
        device: where the state lives.
        dtype: the state's dtype (``FusedOptimizerConfig.state_dtype``).
        rounding_step: add the ``rounding_step`` counter (`has_rounding_step`).

    Returns:
        State name -> tensor (``dtype`` state, int64 0-dim ``step`` and ``rounding_step``).

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
    if rounding_step:
        state[ROUNDING_STEP] = torch.zeros((), dtype=torch.int64, device=device)
    return state


@dataclass(slots=True)
class AdafactorNorm:
    """Running sum of squares of a table's weights, for Adafactor's parameter scale.

    Recomputed from the weights whenever they were written outside the optimizer (the
    tensor's version counter moved); otherwise kept up to date from the touched rows only,
    so a step never reads the whole table. A float64 0-dim tensor on the weights' device, so
    keeping it never waits for the device.
    """

    sum_sq: Tensor | None = None
    version: int = -1


def _l2_and_sign(config: FusedOptimizerConfig, weight_U_D: Tensor, grad_U_D: Tensor) -> Tensor:
    """The gradient after ``maximize`` (negation) and L2 weight decay on the touched rows.

    No L2 term for optimizers that decay inside their update (LAMB: ``weight_decay_in_update``).
    """
    grad = -grad_U_D if config.maximize else grad_U_D
    in_update = registry.optimizer_spec(config.name).weight_decay_in_update
    if config.weight_decay != 0.0 and not in_update:
        grad = grad + config.weight_decay * weight_U_D
    return grad


def _moments(
    config: FusedOptimizerConfig,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None,
) -> tuple[Tensor, Tensor]:
    """Adam's moments of the touched rows, updated in ``state`` (Adam and LAMB share them).

    Returns:
        The new first moment ``[U, D]`` and the second, ``[U, D]`` or, row-wise (one value
        per row: the mean of ``g^2``), ``[U, 1]``; both are copies, free to change in place.
    """
    beta1, beta2 = config.betas
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    m_U_D = exp_avg.index_select(0, rows_U)
    m_U_D.add_(grad_U_D.sub(m_U_D).mul_(1.0 - beta1))
    exp_avg.index_copy_(0, rows_U, m_U_D)
    if exp_avg_sq.dim() == 2:
        v_U_D = exp_avg_sq.index_select(0, rows_U)
        v_U_D.add_(grad_U_D.square().sub_(v_U_D).mul_(1.0 - beta2))
        exp_avg_sq.index_copy_(0, rows_U, v_U_D)
        return m_U_D, v_U_D
    v_U = exp_avg_sq.index_select(0, rows_U)
    v_U.add_(_row_mean_sq(grad_U_D, row_stat).sub_(v_U).mul_(1.0 - beta2))
    exp_avg_sq.index_copy_(0, rows_U, v_U)
    return m_U_D, v_U.unsqueeze(1)


def _adam_like(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
    step: int | None = None,
) -> None:
    """Adam (SparseAdam's formulas) and row-wise Adam on the touched rows."""
    beta1, beta2 = config.betas
    eps = config.eps1 if config.eps1 is not None else 1e-8
    if step is None:
        step = int(state["step"].item())
    m_U_D, v_U_x = _moments(config, state, rows_U, grad_U_D, row_stat)
    denom = v_U_x.sqrt_().add_(eps)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    weight.index_add_(0, rows_U, m_U_D.div_(denom).mul_(-step_size))


def _lamb(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
    step: int | None = None,
) -> None:
    """LAMB and row-wise LAMB on the touched rows: fbgemm's LAMB / PARTIAL_ROWWISE_LAMB.

    Adam's moments of the gradient (no L2 term), the direction ``r = m / (1 - b1^t) /
    (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w`` (row-wise: ``v`` one value per row, the
    mean of ``g^2``), and each row moves by ``-lr * ||w|| / ||r|| * r`` (norms over the row, of
    the weights before the step). A row whose ``r`` is all zero stays where it is (fbgemm's
    kernel would divide 0 by 0 there and write NaN).
    """
    beta1, beta2 = config.betas
    eps = config.eps1 if config.eps1 is not None else 1e-8
    if step is None:
        step = int(state["step"].item())
    m_U_D, v_U_x = _moments(config, state, rows_U, grad_U_D, row_stat)
    denom = v_U_x.div_(1.0 - beta2**step).sqrt_().add_(eps)
    r_U_D = m_U_D.div(1.0 - beta1**step).div_(denom)
    w_U_D = weight.index_select(0, rows_U)
    if config.weight_decay != 0.0:
        r_U_D.add_(w_U_D, alpha=config.weight_decay)
    r_norm_U = torch.linalg.vector_norm(r_U_D, dim=1)
    trust_U = torch.linalg.vector_norm(w_U_D, dim=1).div_(r_norm_U)
    trust_U = torch.where(r_norm_U > 0, trust_U, torch.zeros_like(trust_U))
    weight.index_add_(0, rows_U, r_U_D.mul_(trust_U.mul_(-lr).unsqueeze(1)))


def _sum_sq(x_R_D: Tensor) -> Tensor:
    """Sum of squares in float64 without a full-size temporary: row norms, then their sum.

    A 0-dim tensor on ``x_R_D``'s device (no read back).
    """
    if x_R_D.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x_R_D.device)
    return torch.linalg.vector_norm(x_R_D, dim=1).double().square().sum()


def _adafactor(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    norm: AdafactorNorm,
    step: int | None = None,
) -> None:
    """torch.optim.Adafactor on the dense gradient whose absent rows are zero.

    Exactly that, except decoupled weight decay, which only shrinks the touched rows. The
    parameter scale and the clipping factor stay on the device: nothing is read back.
    """
    rows, dim = weight.shape
    grad = -grad_U_D if config.maximize else grad_U_D
    eps1 = config.eps1 if config.eps1 is not None else torch.finfo(weight.dtype).eps
    if step is None:
        step = int(state["step"].item())
    beta2_t = float(step) ** config.beta2_decay
    rho = min(lr, 1.0 / math.sqrt(step))
    if norm.sum_sq is None or norm.version != weight._version:
        norm.sum_sq = _sum_sq(weight)
    alpha = norm.sum_sq.div(weight.numel()).sqrt_().clamp_(min=config.eps2).mul_(rho)
    # Absent rows have a zero gradient: their row statistic decays, nothing else changes.
    row_var, col_var = state["row_var"], state["col_var"]
    row_var.mul_(1.0 - beta2_t)
    grad_sq_U_D = grad.square()
    row_var.index_add_(0, rows_U, grad_sq_U_D.mean(dim=1).mul_(beta2_t))
    col_var.lerp_(grad_sq_U_D.sum(dim=0).div_(rows), beta2_t)
    del grad_sq_U_D
    row_scale = row_var.mean().clamp(min=eps1)
    decay = 1.0 - lr * config.weight_decay
    apply_rows = adafactor_rows_impl(weight)
    change = apply_rows(
        weight, rows_U, grad, row_var, col_var, row_scale, eps1, alpha, config.clip_threshold, decay
    )
    norm.sum_sq = norm.sum_sq + change
    norm.version = weight._version


def adafactor_rows_torch(
    weight: Tensor,
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_var: Tensor,
    col_var: Tensor,
    row_scale: Tensor,
    eps1: float,
    alpha: Tensor,
    clip_threshold: float,
    decay: float,
) -> Tensor:
    """Adafactor's clipped update of the touched rows (statistics already updated), in place.

    The update is ``g * rsqrt(max(row_var[r] * col_var / row_scale, eps1^2))``, clipped by
    ``max(1, RMS over the whole table / clip_threshold)`` (absent rows' update is 0); each
    touched row becomes ``decay * w - alpha / clip * update``.

    Returns:
        0-dim float64 on the weights' device: the change of the table's sum of squares.
    """
    rows, dim = weight.shape
    w_U_D = weight.index_select(0, rows_U)
    old_sum_sq = _sum_sq(w_U_D)
    if decay != 1.0:
        w_U_D.mul_(decay)
    var_U_D = torch.outer(row_var.index_select(0, rows_U), col_var).div_(row_scale)
    update_U_D = var_U_D.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad_U_D)
    clip = update_U_D.norm().double().div_(math.sqrt(rows * dim) * clip_threshold).clamp_(min=1.0)
    w_U_D.addcmul_(update_U_D, alpha.div(clip).neg_().to(w_U_D.dtype))
    weight.index_copy_(0, rows_U, w_U_D)
    return _sum_sq(w_U_D) - old_sum_sq


AdafactorRows = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor, float, float], Tensor
]


# (code, ids [N], grad offsets [N], scales [N] or None, grad_out, weight, state1, state2,
#  (lr, eps, weight_decay, sign, 1 - beta1, 1 - beta2), step_size) -> None
SparseUpdate = Callable[
    [
        int,
        Tensor,
        Tensor,
        Tensor | None,
        Tensor,
        Tensor,
        Tensor | None,
        Tensor | None,
        tuple[float, float, float, float, float, float],
        float,
    ],
    None,
]


@functools.cache
def _triton_kernels(name: str) -> ModuleType | None:
    """recopt's Triton module ``name``, or None where Triton does not import (tried once)."""
    try:
        return importlib.import_module(f"recopt.kernels.{name}")
    except ImportError:
        return None


def triton_sparse_update() -> SparseUpdate | None:
    """recopt's Triton update for the optimizers with a native code (CUDA), if Triton imports."""
    module = _triton_kernels("triton_sparse")
    return None if module is None else cast(SparseUpdate, module.sparse_update)


def adafactor_rows_impl(weight: Tensor) -> AdafactorRows:
    """Adafactor's touched-row pass for this table: Triton's for float32 on CUDA, if it imports.

    Elsewhere (CPU, other dtypes, a CUDA torch without Triton) `adafactor_rows_torch`.
    """
    if weight.device.type == "cuda" and weight.dtype == torch.float32:
        module = _triton_kernels("triton_adafactor")
        if module is not None:
            return cast(AdafactorRows, module.adafactor_rows)
    return adafactor_rows_torch


def _sgd(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
    step: int | None = None,
) -> None:
    """Plain SGD on the touched rows (no state, no step)."""
    weight.index_add_(0, rows_U, grad_U_D, alpha=-lr)


def _adagrad(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    row_stat: RowStat | None = None,
    step: int | None = None,
) -> None:
    """Adagrad (per element) and row-wise Adagrad (one statistic per row; no step)."""
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
    *,
    step: int | None = None,
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
        step: the table's (advanced) step counter when the caller keeps it on the host;
            ``None`` reads ``state["step"]`` (a device sync off the CPU).

    Raises:
        ValueError: ``adafactor`` without ``norm``.
    """
    if registry.optimizer_spec(config.name).whole_table_statistics:
        table_update = _TABLE_UPDATES.get(config.name)
        if table_update is None:
            raise _no_update(config.name, "_TABLE_UPDATES")
        if norm is None:
            raise ValueError(f"apply_update: {config.name} needs its AdafactorNorm; pass norm=")
        table_update(config, lr, weight, state, rows_U, grad_U_D, norm, step)
        return
    update = _UPDATES.get(config.name)
    if update is None:
        raise _no_update(config.name, "_UPDATES")
    if rows_U.numel() == 0:
        return
    w_U_D = weight.index_select(0, rows_U)
    grad = _l2_and_sign(config, w_U_D, grad_U_D)
    update(config, lr, weight, state, rows_U, grad, row_stat, step)


def apply_update_rounded(
    config: FusedOptimizerConfig,
    lr: float,
    weight: Tensor,
    state: dict[str, Tensor],
    rows_U: Tensor,
    grad_U_D: Tensor,
    generator: torch.Generator | None,
    row_stat: RowStat | None = None,
    *,
    step: int | None = None,
) -> None:
    """`apply_update` for fp16/bf16 weights or state: computed in fp32, rounded back.

    The touched rows of the weights and of every per-row state are copied to fp32 (a compact
    ``[U, ...]`` table), updated there by the optimizer's own rule, and written back with
    `stochastic_round` (``generator``), or rounded to nearest when ``generator`` is None.
    Per-table scalars (``step``) are used as they are (``step``: as in `apply_update`). Not
    for optimizers whose state is not indexed by row (adafactor: refused at construction).
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
    apply_update(
        config, lr, weight_U_D, state_U, local_U, grad_U_D.float(), None, row_stat, step=step
    )

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


def _no_update(name: str, registry_name: str) -> ValueError:
    return ValueError(
        f"fused optimizer {name!r} has no torch update: register its function in "
        f"{registry_name} of recopt/kernels/updates.py"
    )


# The update rule of each optimizer in the registry, by the kind its spec says.
_UPDATES: dict[str, RowUpdate] = {
    registry.SGD.name: _sgd,
    registry.ADAGRAD.name: _adagrad,
    registry.ROW_WISE_ADAGRAD.name: _adagrad,
    registry.ADAM.name: _adam_like,
    registry.ROW_WISE_ADAM.name: _adam_like,
    registry.LAMB.name: _lamb,
    registry.ROW_WISE_LAMB.name: _lamb,
}
_TABLE_UPDATES: dict[str, TableUpdate] = {registry.ADAFACTOR.name: _adafactor}
