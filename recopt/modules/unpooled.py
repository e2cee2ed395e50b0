"""Unpooled lookups as pooled ones: every id becomes a bag of one (what the EC modules share).

An unpooled lookup of feature f's N_f ids equals a SUM-pooled lookup over N_f bags that hold one
id each. Features have different N_f, so each is padded with empty bags (length 0: a zero row,
no gradient) to the common stride S = max_f N_f. Legend: F features, S that stride, D output width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from recopt.modules.config import EmbeddingBagConfig, EmbeddingConfig
from recopt.modules.inputs import FeatureLayout, select_features, with_keys
from recopt.sparse import JaggedTensor, KeyedJaggedTensor


def lookup_bag_configs(tables: Sequence[EmbeddingConfig]) -> list[EmbeddingBagConfig]:
    """The tables as the bag engine's SUM-pooled configs, each feature named by its output key.

    A feature looked up by several tables becomes one virtual feature ``feature@table`` per
    table, so the engine (fused or sharded) sees every lookup as a feature of its own; other
    features keep their names. Feed the engine `select_lookups`' result.
    """
    keys = iter(FeatureLayout(tables).output_keys)  # table order, then feature order
    return [
        dataclasses.replace(
            t.as_bag_config(), feature_names=tuple(next(keys) for _ in t.feature_names)
        )
        for t in tables
    ]


def select_lookups(features: KeyedJaggedTensor, layout: FeatureLayout) -> KeyedJaggedTensor:
    """``features`` as the layout's lookups, keyed by its output keys (see `select_features`).

    Raises:
        ValueError: naming the features the input lacks.
    """
    return with_keys(select_features(features, layout.feature_names), layout.output_keys)


def one_id_bags(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The ids of ``features`` (already selected) as bags of one id, stride ``max(1, max N_f)``.

    Per-id weights are dropped (an unpooled lookup ignores them, as TorchRec's does); a
    variable batch per feature is fine, since only each feature's id count matters.
    """
    counts = features.length_per_key()  # one host read on an accelerator, cached by the KJT
    stride = max([1, *counts])
    device = features.values().device
    counts_F = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    slot_S = torch.arange(stride, dtype=torch.int64, device=device)
    lengths_F_S = (slot_S.unsqueeze(0) < counts_F.unsqueeze(1)).to(torch.int64)
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        lengths=lengths_F_S.reshape(-1),
        stride=stride,
        length_per_key=counts,
    )


def rows_per_feature(
    pooled_S_D: torch.Tensor,
    features: KeyedJaggedTensor,
    dims: Sequence[int],
    need_indices: bool,
) -> dict[str, JaggedTensor]:
    """Cut the pooled one-id bags back into one JaggedTensor per feature.

    Args:
        pooled_S_D: the SUM-pooled lookup of `one_id_bags(features)`: feature f's rows are
            ``[:N_f]`` of its columns.
        features: the selected input (its lengths become the outputs' lengths).
        dims: each feature's row width, in feature order.
        need_indices: put each feature's ids in its JaggedTensor's ``weights`` (TorchRec's
            convention).
    """
    result: dict[str, JaggedTensor] = {}
    counts = features.length_per_key()
    ids = features.values()
    bag_starts = features.lengths_offset_per_key()
    id_start, col = 0, 0
    for f, key in enumerate(features.keys()):
        count, dim = counts[f], dims[f]
        result[key] = JaggedTensor(
            values=pooled_S_D[:count, col : col + dim],
            lengths=features.lengths()[bag_starts[f] : bag_starts[f + 1]],
            weights=ids[id_start : id_start + count] if need_indices else None,
        )
        id_start += count
        col += dim
    return result


def meta_rows_per_feature(
    inputs: Mapping[str, JaggedTensor], dims: Sequence[int], need_indices: bool
) -> dict[str, JaggedTensor]:
    """Shapes only, for a collection built on the meta device (build-on-meta, then shard).

    Args:
        inputs: output key -> the feature's input bags.
        dims: each output's row width.
        need_indices: as in `rows_per_feature`.
    """
    meta = torch.device("meta")
    result: dict[str, JaggedTensor] = {}
    for (key, jt), dim in zip(inputs.items(), dims, strict=True):
        result[key] = JaggedTensor(
            values=torch.empty(jt.values().shape[0], dim, device=meta),
            lengths=jt.lengths().to(meta),
            weights=jt.values().to(meta) if need_indices else None,
        )
    return result
