"""Adafactor's update of the touched rows as two Triton kernels (recopt's CUDA path).

Imported only where Triton is (torch's CUDA builds ship it; `updates.adafactor_rows_impl`
guards the import), never a required dependency. The whole-table statistics (row and column
variances, their mean) stay torch ops; these kernels do the per-row work without any
``[U, D]`` temporary: pass 1 sums each row's squared update (for the clipping norm), pass 2
recomputes the update, applies decay and the clipped step, and sums the rows' squares before
and after (the running weight norm). Nothing is read back to the host. Under
``TRITON_INTERPRET=1`` they also run on CPU tensors (how the CPU tests check them).
Legend: U touched rows, D the table's dim.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


@triton.jit
def _update_sq_kernel(
    grad_ptr,
    rows_ptr,
    row_var_ptr,
    col_var_ptr,
    row_scale_ptr,
    update_sq_ptr,
    D,
    eps1_sq,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(rows_ptr + u)
    g = tl.load(grad_ptr + u * D + cols, mask=mask, other=0.0)
    var = tl.load(row_var_ptr + row) * tl.load(col_var_ptr + cols, mask=mask, other=1.0)
    var = tl.maximum(var / tl.load(row_scale_ptr), eps1_sq)
    update = tl.where(mask, tl.rsqrt(var) * g, 0.0)
    tl.store(update_sq_ptr + u, tl.sum(update * update, axis=0))


@triton.jit
def _apply_kernel(
    weight_ptr,
    grad_ptr,
    rows_ptr,
    row_var_ptr,
    col_var_ptr,
    row_scale_ptr,
    step_size_ptr,
    old_sq_ptr,
    new_sq_ptr,
    D,
    eps1_sq,
    decay,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(rows_ptr + u)
    w = tl.load(weight_ptr + row * D + cols, mask=mask, other=0.0)
    tl.store(old_sq_ptr + u, tl.sum(w * w, axis=0))
    g = tl.load(grad_ptr + u * D + cols, mask=mask, other=0.0)
    var = tl.load(row_var_ptr + row) * tl.load(col_var_ptr + cols, mask=mask, other=1.0)
    var = tl.maximum(var / tl.load(row_scale_ptr), eps1_sq)
    w = w * decay + (tl.rsqrt(var) * g) * tl.load(step_size_ptr)
    tl.store(weight_ptr + row * D + cols, w, mask=mask)
    w = tl.where(mask, w, 0.0)
    tl.store(new_sq_ptr + u, tl.sum(w * w, axis=0))


def adafactor_rows(
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
    """Apply Adafactor's clipped update to the touched rows of ``weight``, in place.

    Same contract as `updates.adafactor_rows_torch` (statistics already updated).

    Args:
        weight: ``[R, D]`` float32 table, contiguous.
        rows_U: sorted unique touched rows (int64).
        grad_U_D: their gradients (sign already applied).
        row_var: ``[R]`` row statistics; ``col_var``: ``[D]`` column statistics.
        row_scale: 0-dim, ``max(mean(row_var), eps1)``.
        eps1: Adafactor's eps1; the variance floor is ``eps1**2``.
        alpha: 0-dim float64, the step's scale ``max(eps2, RMS(table)) * rho``.
        clip_threshold: torch's ``d``.
        decay: ``1 - lr * weight_decay`` (1.0 without weight decay).

    Returns:
        0-dim float64: the change of the table's sum of squares.
    """
    num_rows, dim = weight.shape
    count = rows_U.numel()
    if count == 0:
        return torch.zeros((), dtype=torch.float64, device=weight.device)
    grad_U_D = grad_U_D.contiguous().to(weight.dtype)
    rows_U = rows_U.to(torch.int64).contiguous()  # int64: row * D may pass 2^31
    scale = row_scale.to(torch.float32).reshape(1)
    block = triton.next_power_of_2(dim)
    update_sq_U = torch.empty(count, dtype=torch.float32, device=weight.device)
    _update_sq_kernel[(count,)](
        grad_U_D, rows_U, row_var, col_var, scale, update_sq_U, dim, eps1 * eps1, BLOCK_D=block
    )
    denominator = math.sqrt(num_rows * dim) * clip_threshold
    clip = update_sq_U.double().sum().sqrt_().div_(denominator).clamp_(min=1.0)
    step_size = alpha.div(clip).neg_().to(torch.float32).reshape(1)
    old_sq_U = torch.empty_like(update_sq_U)
    new_sq_U = torch.empty_like(update_sq_U)
    _apply_kernel[(count,)](
        weight,
        grad_U_D,
        rows_U,
        row_var,
        col_var,
        scale,
        step_size,
        old_sq_U,
        new_sq_U,
        dim,
        eps1 * eps1,
        decay,
        BLOCK_D=block,
    )
    return new_sq_U.double().sum() - old_sq_U.double().sum()
