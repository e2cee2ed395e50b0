"""A batch after its id maps' remap: rows in place of the mapped features' raw ids.

`apply_rows` writes each id-mapped table's rows (`Remapped.rows_M`) over its features' ids
(`table_ids` gives those ids, in the same order) and drops the ids that read the zero row
from their bags; `mean_scale` then rescales mean-pooled bags that lost ids, whose divisor
stays their full id count. Legend: F features, B batch size, M ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from recopt.kernels import cpu_id_map
from recopt.kernels.config import PoolingType
from recopt.modules.id_map import Remapped
from recopt.modules.inputs import FeatureLayout
from recopt.sparse import KeyedJaggedTensor


@dataclass(slots=True)
class MappedBatch:
    """A batch after the remap: its features (rows), the fresh rows per table, the drops.

    ``lengths_before`` is set when ids were dropped (zero row): the bag lengths before the
    drop, for `mean_scale`.
    """

    features: KeyedJaggedTensor
    fresh: dict[str, Remapped] = field(default_factory=dict)
    lengths_before: torch.Tensor | None = None


def table_ids(
    features: KeyedJaggedTensor, layout: FeatureLayout, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Per table of ``names``: the raw ids of all its features, feature after feature (the
    features' views made by one split)."""
    per_feature = features.values().split(features.length_per_key())
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for f, table in enumerate(layout.table_names):
        if table in parts:
            parts[table].append(per_feature[f])
    return {name: p[0] if len(p) == 1 else torch.cat(p) for name, p in parts.items()}


def rows_buffer(
    features: KeyedJaggedTensor, layout: FeatureLayout, names: Sequence[str]
) -> torch.Tensor | None:
    """A new tensor for ``features``' values with rows in place of the raw ids, for the native
    remap to write each table's rows into (`remap_tables`' ``rows_into``), where that is all
    the batch needs: every value is an id of a table of ``names``, each table's features next
    to each other and the tables in ``names`` order (so `table_ids`' order is the values'),
    int64 on the host. Else None (`apply_rows` puts the rows together)."""
    values = features.values()
    if values.dtype != torch.int64 or values.device.type != "cpu":
        return None
    tables = layout.table_names
    runs = [t for i, t in enumerate(tables) if i == 0 or tables[i - 1] != t]
    if runs != list(names) or features.offset_per_key()[len(tables)] != values.numel():
        return None
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def apply_rows(
    features: KeyedJaggedTensor,
    layout: FeatureLayout,
    results: Mapping[str, Remapped],
    rows_into: torch.Tensor | None = None,
) -> MappedBatch:
    """``features`` with each mapped table's ids replaced by ``results[table].rows_M``
    (aligned with `table_ids`); ids of the zero row (-1) are dropped from their bags.
    ``rows_into``: the `rows_buffer` given to the remap, if its rows went there (every
    ``rows_M`` a piece of it), else None."""
    if rows_into is not None and _written_into(results, rows_into):
        rows, mapped = rows_into, [True] * len(layout.table_names) + [False]
    else:
        pieces, mapped = _row_pieces(features, layout, results)
        rows = torch.cat(pieces)
    batch = MappedBatch(features, dict(results))
    if not _any_zero_row(results):
        batch.features = features.with_values(rows)  # its counts, read already, hold
        return batch
    weights, lengths = features.weights_or_none(), features.lengths()
    keys = len(features.keys())
    key_mapped = (mapped[:-1] + [False] * keys)[:keys]  # the last piece is past every key
    kept_rows, kept_weights, kept, per_key = drop_zero_rows(
        rows, features.offsets(), features.offset_per_key(), key_mapped, weights
    )
    batch.features = KeyedJaggedTensor(
        features.keys(),
        kept_rows,
        weights=kept_weights,
        lengths=kept.to(lengths.dtype),
        stride=features.stride(),
        length_per_key=per_key,
    )
    batch.lengths_before = lengths
    return batch


def drop_zero_rows(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    key_bounds: Sequence[int],
    mapped: Sequence[bool],
    weights: torch.Tensor | None,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list[int]]:
    """``rows`` with the zero row's ids (-1) dropped from the bags of the keys marked in
    ``mapped`` (key k: ``rows[key_bounds[k]:key_bounds[k + 1]]``, as many bags as every other
    key, ``offsets`` into ``rows``; the other keys' values, and those past the last key, stay
    whatever they are): the kept rows, their ``weights`` (None: unweighted), each bag's kept
    count (int64) and each key's. Native on CPU (`cpu_id_map.drop_zero_rows`) unless
    ``native`` is False, else torch ops.
    """
    done = cpu_id_map.drop_zero_rows(rows, offsets, mapped, weights) if native else None
    if done is not None:
        return done
    ends = [*key_bounds[1:], rows.numel()]
    if all(is_mapped or a == b for a, b, is_mapped in zip(key_bounds, ends, mapped, strict=False)):
        dropped = rows < 0  # all rows: one pass
    else:
        parts = [
            rows[a:b] < 0 if is_mapped else torch.zeros(b - a, dtype=torch.bool, device=rows.device)
            for a, b, is_mapped in zip(key_bounds, key_bounds[1:], mapped, strict=False)
        ]
        past = key_bounds[-1]
        parts.append(torch.zeros(rows.numel() - past, dtype=torch.bool, device=rows.device))
        dropped = torch.cat(parts)
    keep = ~dropped
    # kept ids before each position: a bag's kept count is the difference at its bounds
    before = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(keep, 0, out=before[1:])
    kept = before.index_select(0, offsets.to(rows.device, torch.int64)).diff()
    bounds = torch.tensor(list(key_bounds), device=rows.device)
    per_key = before.index_select(0, bounds).diff().tolist()  # (the mask below reads too)
    kept_weights = None if weights is None else weights.masked_select(keep)
    return rows.masked_select(keep), kept_weights, kept, per_key


def _any_zero_row(results: Mapping[str, Remapped]) -> bool:
    """Whether an id of ``results`` reads the zero row (-1): what the host side read before
    the rows went to a device (``zero_row``), else one check over all tables."""
    if results and all(r.zero_row is not None for r in results.values()):
        return any(r.zero_row for r in results.values())
    rows = [r.rows_M for r in results.values() if r.rows_M.numel()]
    return bool(rows) and bool((torch.cat(rows) < 0).any())


def _written_into(results: Mapping[str, Remapped], rows_into: torch.Tensor) -> bool:
    """Whether the remap wrote ``results``' rows into ``rows_into`` (it does where every map
    stepped natively; its first rows then start there)."""
    first = next(iter(results.values()), None)
    return first is not None and first.rows_M.data_ptr() == rows_into.data_ptr()


def _row_pieces(
    features: KeyedJaggedTensor, layout: FeatureLayout, results: Mapping[str, Remapped]
) -> tuple[list[torch.Tensor], list[bool]]:
    """``features``' values cut at the feature bounds, each mapped feature's piece replaced by
    its rows (its table's ``rows_M``, features in order), and which pieces are rows."""
    values, bounds = features.values(), features.offset_per_key()
    used = dict.fromkeys(results, 0)
    pieces, mapped = [], []
    for f, name in enumerate(layout.table_names):
        a, b = bounds[f], bounds[f + 1]
        result = results.get(name)
        if result is None:
            pieces.append(values[a:b])
        else:
            start = used[name]
            pieces.append(result.rows_M[start : start + b - a].to(values.dtype))
            used[name] = start + b - a
        mapped.append(result is not None)
    pieces.append(values[bounds[len(layout.table_names)] :])  # past the layout's features
    mapped.append(False)
    return pieces, mapped


def mean_scale(
    pooled_B_D: torch.Tensor,
    batch: MappedBatch,
    layout: FeatureLayout,
    poolings: Sequence[PoolingType],
) -> torch.Tensor:
    """``pooled_B_D`` with each mean-pooled bag that lost ids to the zero row rescaled.

    The lookup divided the kept rows' sum by the kept count; the zero rows count too, so the
    bag is multiplied by kept / before (``poolings``: per feature of ``layout``).
    """
    if batch.lengths_before is None or PoolingType.MEAN not in poolings:
        return pooled_B_D
    size = pooled_B_D.shape[0]
    kept = batch.features.lengths().to(pooled_B_D.dtype)
    before = batch.lengths_before.to(pooled_B_D.dtype)
    ratio_F_B = (kept / before.clamp(min=1)).view(len(poolings), size)
    columns = [
        (ratio_F_B[f] if pooling is PoolingType.MEAN else torch.ones_like(ratio_F_B[f]))
        .unsqueeze(1)
        .expand(size, dim)
        for f, (pooling, dim) in enumerate(zip(poolings, layout.dims, strict=True))
    ]
    return pooled_B_D * torch.cat(columns, dim=1)
