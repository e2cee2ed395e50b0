"""The backward passes of recopt's kernel (`recopt_backend`), and the autograd Function.

Per table, the touched rows' summed gradients (torch ops, or the native sort and sum), the
Triton and native updates that skip that step, and the per-sample-weight gradient. Functions
of the kernel (its tables, optimizer and step state), kept apart from its module surface.
Legend: B batch, F features, N ids (occurrences) of one table, D a table's dim, U unique rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from recopt.kernels import cpu_fused, updates
from recopt.kernels.config import PoolingType

if TYPE_CHECKING:
    from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

Tensor = torch.Tensor


@dataclass(slots=True)
class _Occurrences:
    """The ids of one table in a batch, with where each one's gradient comes from.

    The two gradient indices are derived on demand: each backward path reads one of them.
    """

    ids_N: Tensor
    bags: list[Tensor]  # per feature slot, each occurrence's bag (sample) in the batch
    cols: list[int]  # first grad_out column of each of the table's features (slot order)
    scale_N: Tensor | None  # per-sample weight x 1/length (mean), None when all ones

    def goff_N(self, output_dim: int) -> Tensor:
        """Element offset of each occurrence's bag row in the flat grad_out."""
        return torch.cat(
            [bag * output_dim + col for bag, col in zip(self.bags, self.cols, strict=True)]
        )

    def row_N(self, batch: int) -> Tensor:
        """Row of the table's stacked feature gradients: feature slot * B + sample."""
        return torch.cat([bag + slot * batch for slot, bag in enumerate(self.bags)])


def occurrences(
    kernel: RecoptTableBatchedEmbedding,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    bounds: tuple[int, list[int]],
) -> list[_Occurrences | None]:
    """Per table, the ids of all its features with their gradient rows and scales."""
    batch, starts = bounds
    mean = kernel.pooling == PoolingType.MEAN
    parts: list[list[tuple[Tensor, Tensor, int, Tensor | None]]] = [[] for _ in kernel.tables]
    for f, t in enumerate(kernel.feature_table_map):
        if starts[f + 1] == starts[f]:
            continue
        lengths_B = offsets[f * batch : (f + 1) * batch + 1].diff()
        bag_N = torch.repeat_interleave(
            torch.arange(batch, device=indices.device),
            lengths_B,
            output_size=starts[f + 1] - starts[f],
        )
        scale_N = None if weights is None else weights[starts[f] : starts[f + 1]].float()
        if mean:
            inv_B = 1.0 / lengths_B.clamp(min=1).float()
            scale_N = inv_B[bag_N] if scale_N is None else scale_N * inv_B[bag_N]
        parts[t].append(
            (indices[starts[f] : starts[f + 1]], bag_N, kernel._col_offsets[f], scale_N)
        )
    result: list[_Occurrences | None] = []
    for table_parts in parts:
        if not table_parts:
            result.append(None)
            continue
        ids = torch.cat([p[0] for p in table_parts])
        scales = [p[3] for p in table_parts]
        scale = None if scales[0] is None else torch.cat([x for x in scales if x is not None])
        bags = [p[1] for p in table_parts]
        result.append(_Occurrences(ids, bags, [p[2] for p in table_parts], scale))
    return result


def triton_update(
    kernel: RecoptTableBatchedEmbedding,
    sparse_update: updates.SparseUpdate,
    grad_out: Tensor,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    bounds: tuple[int, list[int]],
    steps: list[int],
) -> None:
    """Every table's touched rows updated by Triton (no torch.unique: no host sync)."""
    hyper = _hyperparameters(kernel)
    code = kernel._spec.c_code
    assert code is not None  # checked by _triton_update_fn
    states = kernel.split_optimizer_states()
    for t, occ in enumerate(occurrences(kernel, indices, offsets, weights, bounds)):
        if occ is None:
            continue
        weight = kernel.weights[t].detach()
        goff_N = occ.goff_N(kernel.output_dim)
        args = (occ.ids_N, goff_N, occ.scale_N, grad_out, weight, *_state_slots(states[t]))
        sparse_update(code, *args, hyper, _step_size(kernel, steps[t]))


def _hyperparameters(
    kernel: RecoptTableBatchedEmbedding,
) -> tuple[float, float, float, float, float, float]:
    """(lr, eps, weight decay, sign, 1 - beta1, 1 - beta2): the native and Triton updates' order."""
    config = kernel.optimizer
    beta1, beta2 = config.betas
    eps = config.eps1 if config.eps1 is not None else 1e-8
    sign = -1.0 if config.maximize else 1.0
    return (kernel._lr, eps, config.weight_decay, sign, 1.0 - beta1, 1.0 - beta2)


def _step_size(kernel: RecoptTableBatchedEmbedding, step: int) -> float:
    """Adam's bias-corrected step size at ``step`` (0.0 for optimizers without a step)."""
    if not kernel._spec.stepped:
        return 0.0
    beta1, beta2 = kernel.optimizer.betas
    return kernel._lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def _state_slots(state: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
    """The first (momentum1 / exp_avg) and second (exp_avg_sq) state tensors, if any."""
    return state.get("momentum1", state.get("exp_avg")), state.get("exp_avg_sq")


def torch_row_grads(
    kernel: RecoptTableBatchedEmbedding,
    grad_out: Tensor,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    bounds: tuple[int, list[int]],
) -> list[tuple[Tensor, Tensor] | None]:
    """Per table, its sorted unique touched rows and their summed gradients (torch ops).

    ``torch.unique`` sizes its result from the data, which on a GPU waits for the device
    inside torch (no read of ours; docs/kernels.md, "Host syncs").
    """
    result: list[tuple[Tensor, Tensor] | None] = []
    for t, occ in enumerate(occurrences(kernel, indices, offsets, weights, bounds)):
        if occ is None:
            result.append(None)
            continue
        rows_U, inverse_N = torch.unique(occ.ids_N, sorted=True, return_inverse=True)
        dim = kernel.tables[t].embedding_dim
        blocks = [grad_out[:, c0 : c0 + dim] for c0 in occ.cols]
        grad_rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        grad_N_D = grad_rows.index_select(0, occ.row_N(bounds[0]))
        if occ.scale_N is not None:
            grad_N_D = grad_N_D * occ.scale_N.to(grad_N_D.dtype).unsqueeze(1)
        grad_U_D = grad_N_D.new_zeros(rows_U.numel(), dim)
        grad_U_D.index_add_(0, inverse_N, grad_N_D)
        result.append((rows_U, grad_U_D))
    return result


def sorted_occurrences(
    kernel: RecoptTableBatchedEmbedding, indices: Tensor, offsets: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Every id of the batch as a (table base + id, grad offset) word, sorted by key."""
    batch = (offsets.numel() - 1) // len(kernel.feature_table_map)
    words_N, scale_N = cpu_fused.prepare_sorted(
        indices.contiguous(),
        offsets.contiguous(),
        None if weights is None else weights.contiguous(),
        kernel.pooling == PoolingType.MEAN,
        batch,
        kernel._feature_base,
        kernel._feature_col,
        kernel.output_dim,
        kernel._table_bases[-1],
    )
    return words_N, scale_N


def native_row_grads(
    kernel: RecoptTableBatchedEmbedding,
    grad_out: Tensor,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
) -> list[tuple[Tensor, Tensor] | None]:
    """As `torch_row_grads`, from the native sort and a native sum per touched row."""
    if indices.numel() == 0:
        return [None] * len(kernel.tables)
    words_N, scale_N = sorted_occurrences(kernel, indices, offsets, weights)
    keys_N = (words_N >> 32) & 0xFFFFFFFF  # the words are unsigned, stored as int64
    keys_U, counts_U = torch.unique_consecutive(keys_N, return_counts=True)
    starts_U = torch.cat([counts_U.new_zeros(1), counts_U.cumsum(0)])
    runs = torch.searchsorted(keys_U, torch.tensor(kernel._table_bases)).tolist()
    result: list[tuple[Tensor, Tensor] | None] = []
    for t, table in enumerate(kernel.tables):
        u0, u1 = runs[t], runs[t + 1]
        if u0 == u1:
            result.append(None)
            continue
        first, last = int(starts_U[u0]), int(starts_U[u1])
        grad_U_D = cpu_fused.aggregate(
            words_N[first:last],
            None if scale_N is None else scale_N[first:last],
            grad_out,
            starts_U[u0 : u1 + 1] - first,
            table.embedding_dim,
        )
        result.append((keys_U[u0:u1] - kernel._table_bases[t], grad_U_D))
    return result


def native_update(
    kernel: RecoptTableBatchedEmbedding,
    grad_out: Tensor,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    steps: list[int],
    seed: int = 0,
) -> None:
    """All tables in one pass: keys (table base + id) sorted once, then one native update.

    ``seed``: the pass's stochastic-rounding seed (the kernel's `RoundingStream`); each
    touched row hashes it with its key.
    """
    if indices.numel() == 0:
        return
    words_N, scale_N = sorted_occurrences(kernel, indices, offsets, weights)
    step_sizes = [_step_size(kernel, step) for step in steps]
    states = kernel.split_optimizer_states()
    tensors = [(w.detach(), *_state_slots(s)) for w, s in zip(kernel.weights, states, strict=True)]
    code = kernel._spec.c_code
    assert code is not None  # checked by _native_ok
    cpu_fused.fused_update(
        code,
        words_N,
        scale_N,
        grad_out,
        kernel._table_bases,
        tensors,
        list(_hyperparameters(kernel)),
        step_sizes,
        seed,
        stochastic=kernel.optimizer.stochastic_rounding,
    )


def per_sample_weight_grad(
    kernel: RecoptTableBatchedEmbedding,
    grad_out: Tensor,
    indices: Tensor,
    offsets: Tensor,
    weights: Tensor,
    bounds: tuple[int, list[int]],
) -> Tensor:
    """d loss / d weight_i = <grad of its bag, its row> (/ length for mean pooling)."""
    batch, starts = bounds
    grads = []
    for f, t in enumerate(kernel.feature_table_map):
        lengths_B = offsets[f * batch : (f + 1) * batch + 1].diff()
        bag_N = torch.repeat_interleave(
            torch.arange(batch, device=indices.device),
            lengths_B,
            output_size=starts[f + 1] - starts[f],
        )
        ids_N = indices[starts[f] : starts[f + 1]]
        rows_N_D = kernel.weights[t].detach().index_select(0, ids_N).to(grad_out.dtype)
        c0 = kernel._col_offsets[f]
        g_N_D = grad_out[:, c0 : c0 + rows_N_D.shape[1]].index_select(0, bag_N)
        g_N = (rows_N_D * g_N_D).sum(dim=1)
        if kernel.pooling == PoolingType.MEAN:
            g_N = g_N / lengths_B.clamp(min=1)[bag_N].to(g_N.dtype)
        grads.append(g_N)
    return torch.cat(grads).to(weights.dtype) if grads else torch.zeros_like(weights)


class FusedEmbeddingFunction(torch.autograd.Function):
    """Pooling whose backward updates the tables in place and returns no weight gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        kernel: RecoptTableBatchedEmbedding,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        bounds: tuple[int, list[int]],
        *weights: Tensor,
    ) -> Tensor:
        ctx.kernel = kernel
        ctx.bounds = bounds
        ctx.num_weights = len(weights)
        ctx.has_psw = per_sample_weights is not None
        if per_sample_weights is not None:
            ctx.save_for_backward(indices, offsets, per_sample_weights)
        else:
            ctx.save_for_backward(indices, offsets)
        return kernel._pool(indices, offsets, per_sample_weights, bounds)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        kernel: RecoptTableBatchedEmbedding = ctx.kernel
        saved = ctx.saved_tensors
        indices, offsets = saved[0], saved[1]
        psw = saved[2] if ctx.has_psw else None
        grad_out = grad_out.contiguous()
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[3]:
            # Before the update: the gradient is taken at the weights forward used.
            grad_psw = per_sample_weight_grad(kernel, grad_out, indices, offsets, psw, ctx.bounds)
        with torch.no_grad():
            kernel._apply_optimizer(grad_out, indices, offsets, psw, ctx.bounds)
        return (None, None, None, grad_psw, None, *([None] * ctx.num_weights))
