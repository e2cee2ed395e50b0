"""A rank's lookup of what it received: kernel inputs over the global batch, and the rows back.

Input distribution (`input_dist`) hands over, per source rank, the lengths, ids and weights of
this rank's virtual features; the kernels want them feature-major over the global padded batch
(each feature's bags of rank 0, then rank 1, ...). This module reorders them without reading
anything back (every id count comes from the count exchange's host copy), runs each kernel,
and lays its pooled rows out in source order for the output exchange.
Legend: W world size, V virtual features, B the padded batch of one source (Bm).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from recopt.kernels.contract import Kernel

Tensor = torch.Tensor


class KernelInput(NamedTuple):
    """One kernel's input: ids, bag offsets, per-id weights, and each feature's first id
    (``offsets[f * B]`` for f in 0..F, host ints: the kernel's ``offset_per_key``)."""

    ids: Tensor
    offsets: Tensor
    weights: Tensor | None
    bounds: list[int]


def segment_transpose(values: Tensor, seg_W_V: Tensor) -> Tensor:
    """Reorder segments laid out (w, v)-major into (v, w)-major order, vectorised, no sync.

    Args:
        values: the concatenated segments, ``seg_W_V[0, 0]`` entries first, then ``[0, 1]``...
        seg_W_V: ``[W, V]`` segment sizes (int64).

    Returns:
        The same entries with segment ``(w, v)`` moved to position ``(v, w)``.
    """
    n = values.numel()
    if n == 0 or seg_W_V.shape[0] == 1 or seg_W_V.shape[1] == 1:
        return values
    flat = seg_W_V.reshape(-1)
    starts_W_V = (torch.cumsum(flat, 0) - flat).view(seg_W_V.shape)
    seg_V_W = seg_W_V.t().reshape(-1)
    new_starts = torch.cumsum(seg_V_W, 0) - seg_V_W
    shift = torch.repeat_interleave(starts_W_V.t().reshape(-1) - new_starts, seg_V_W, output_size=n)
    return values[shift + torch.arange(n, device=values.device)]


def kernel_inputs(
    num_features: int,
    group_sizes: list[int],
    max_batch: int,
    lengths: list[Tensor],
    ids: list[Tensor],
    weights: list[Tensor | None],
    id_counts: list[list[int]],
) -> list[KernelInput]:
    """Kernel inputs over the global (padded) batch: feature-major, each feature's bags of
    rank 0, then rank 1, ... (received source-major; kernels need a table's features
    contiguous, which fbgemm's exact optimizers rely on). Every id count comes from the
    count exchange's host copy (``id_counts[source][feature]``): nothing is read back."""
    lengths_W_V_B = torch.stack([x.view(num_features, max_batch) for x in lengths])
    seg_W_V = lengths_W_V_B.sum(2)
    all_ids = segment_transpose(torch.cat(ids), seg_W_V)
    all_w = None
    if weights[0] is not None:
        all_w = segment_transpose(torch.cat(weights), seg_W_V)  # type: ignore[arg-type]
    lengths_V_W_B = lengths_W_V_B.transpose(0, 1)
    per_feature = [sum(col) for col in zip(*id_counts, strict=True)]
    if len(group_sizes) == 1:
        offsets = _offsets(lengths_V_W_B.reshape(-1))
        return [KernelInput(all_ids, offsets, all_w, _bounds(per_feature))]
    bounds = _bounds(group_sizes)
    id_sizes = [sum(per_feature[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    id_parts = all_ids.split(id_sizes)
    w_parts = None if all_w is None else all_w.split(id_sizes)
    result = []
    for i in range(len(group_sizes)):
        lens = lengths_V_W_B[bounds[i] : bounds[i + 1]].reshape(-1)
        result.append(
            KernelInput(
                id_parts[i],
                _offsets(lens),
                None if w_parts is None else w_parts[i],
                _bounds(per_feature[bounds[i] : bounds[i + 1]]),
            )
        )
    return result


def send_buffer(outs: list[Tensor], batch_sizes: list[int], max_batch: int) -> Tensor:
    """The kernels' pooled rows ``[S * Bm, D_k]`` as the output exchange sends them: per source,
    its ``batch_sizes[s]`` real rows (padding dropped), every kernel's columns side by side."""
    if len(outs) == 1 and min(batch_sizes) == max_batch:
        return outs[0].reshape(-1)  # rows already in source order, no padding to drop
    pieces = []
    for s, b in enumerate(batch_sizes):
        rows = [out[s * max_batch : s * max_batch + b] for out in outs]
        block = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        pieces.append(block.reshape(-1))
    return torch.cat(pieces)


def run_kernel(kernel: Kernel, x: KernelInput) -> Tensor:
    """One kernel's lookup, given its feature bounds from the host (the kernel reads nothing)."""
    out: Tensor = kernel(x.ids, x.offsets, x.weights, offset_per_key=x.bounds)
    return out


def _bounds(sizes: list[int]) -> list[int]:
    """Where each part starts, then the total (host ints): a feature's first id, a group's
    first feature."""
    return list(itertools.accumulate(sizes, initial=0))


def _offsets(lengths: Tensor) -> Tensor:
    offsets = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets
