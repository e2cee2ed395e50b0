"""Variable batch per feature for the embedding-bag collections (plain, fused and sharded).

A KJT whose features have different bag counts is padded with empty bags to one batch (the
largest feature's), looked up unchanged, and each feature's pooled rows are then gathered back
to the full batch through the KJT's ``inverse_indices`` (TorchRec's meaning: row ``b`` of
feature ``f`` is that feature's bag ``inverse_indices[f][b]``).
Legend: F the collection's features, S the padded batch, B the full batch, D output width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recopt.modules.inputs import require_features
from recopt.sparse import KeyedJaggedTensor


def regular_batch(
    features: KeyedJaggedTensor, feature_names: Sequence[str]
) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    """Return ``features`` with one batch for all keys, and the rows to expand the output by.

    Args:
        features: the input; may have a variable batch per feature and ``inverse_indices``.
        feature_names: the collection's features in output order (repeated when shared).

    Returns:
        A KJT with a regular batch (smaller features padded at the end with empty bags, so
        their bag ``i`` is still row ``i`` of the pooled output), and ``index_F_B``, each
        collection feature's bag for every sample of the full batch, or None when the
        pooled output needs no expansion (no ``inverse_indices`` given).

    Raises:
        ValueError: the batch varies per feature and no ``inverse_indices`` say how to
            expand it, ``inverse_indices`` lack a feature or have the wrong shape or dtype,
            or an inverse index is outside its feature's bags. Nothing is looked up then.
    """
    inverse = features.inverse_indices_or_none()
    strides = features.stride_per_key()
    if inverse is None or inverse[1].numel() == 0:
        if len(set(strides)) > 1:
            raise ValueError(
                f"the input has a variable batch per feature (stride_per_key {strides} for "
                f"keys {features.keys()}) but no inverse_indices; pass inverse_indices="
                "(keys, [num_keys, batch] tensor) to the KeyedJaggedTensor so each feature's "
                "pooled rows can be expanded to the full batch"
            )
        return _padded(features, strides), None
    index_F_B = _inverse_rows(inverse, features, feature_names)
    return _padded(features, strides), index_F_B


def expand_rows(
    pooled_S_D: torch.Tensor, dims: Sequence[int], index_F_B: torch.Tensor
) -> torch.Tensor:
    """Gather each feature's columns of ``pooled_S_D`` at its rows ``index_F_B[f]``: [B, D].

    One gather for all features (its backward adds the gradients of repeated rows).
    """
    width = pooled_S_D.shape[1]
    device = pooled_S_D.device
    col_feature = torch.repeat_interleave(
        torch.arange(len(dims), device=device),
        torch.tensor(list(dims), device=device),
        output_size=width,
    )
    rows_B_D = index_F_B.index_select(0, col_feature).t()
    flat_B_D = rows_B_D * width + torch.arange(width, device=device)
    return pooled_S_D.reshape(-1).index_select(0, flat_B_D.reshape(-1)).view(-1, width)


def _padded(features: KeyedJaggedTensor, strides: list[int]) -> KeyedJaggedTensor:
    """``features`` with every key's bags padded to the largest count (no copy if regular)."""
    if not features.variable_stride_per_key() and features.inverse_indices_or_none() is None:
        return features
    width = max(strides, default=0)
    lengths = features.lengths()
    if any(s != width for s in strides):
        parts: list[torch.Tensor] = []
        for part, stride in zip(lengths.split(strides), strides, strict=True):
            parts.extend([part, lengths.new_zeros(width - stride)])
        lengths = torch.cat(parts) if parts else lengths
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        weights=features.weights_or_none(),
        lengths=lengths,
        stride=width,
        length_per_key=features.length_per_key_or_none(),
    )


def _inverse_rows(
    inverse: tuple[list[str], torch.Tensor],
    features: KeyedJaggedTensor,
    feature_names: Sequence[str],
) -> torch.Tensor:
    """The inverse-index row of every collection feature, checked against its bag count."""
    keys, index = inverse
    if index.dim() != 2 or len(keys) != index.shape[0] or index.is_floating_point():
        raise ValueError(
            f"inverse_indices must be (keys, integer tensor [len(keys), batch]); got "
            f"{len(keys)} keys and a {index.dtype} tensor of shape {list(index.shape)}"
        )
    row_of = {k: i for i, k in enumerate(keys)}
    missing = [f for f in dict.fromkeys(feature_names) if f not in row_of]
    if missing:
        raise ValueError(
            f"inverse_indices have no row for features {missing} (their keys are {keys}); "
            "give one row per feature of the input"
        )
    require_features(features.keys(), feature_names)
    stride_of = dict(zip(features.keys(), features.stride_per_key(), strict=True))
    rows = torch.tensor([row_of[f] for f in feature_names], device=index.device)
    index_F_B = index.index_select(0, rows).to(torch.int64)
    limits = torch.tensor([stride_of[f] for f in feature_names], device=index.device)
    bad_F_B = (index_F_B < 0) | (index_F_B >= limits.unsqueeze(1))
    if index_F_B.numel() and bool(bad_F_B.any()):  # one host read; CUDA gathers cannot raise
        f = int(bad_F_B.any(dim=1).nonzero()[0, 0])
        value = int(index_F_B[f][bad_F_B[f]][0])
        raise ValueError(
            f"inverse_indices of feature {feature_names[f]!r} hold {value}, but the feature "
            f"has {stride_of[feature_names[f]]} bags; every inverse index must be in "
            f"0..{stride_of[feature_names[f]] - 1}"
        )
    return index_F_B
