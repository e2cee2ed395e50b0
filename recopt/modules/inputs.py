"""Input handling shared by the embedding-bag modules: feature order, weights, id bounds.

fbgemm's own bounds check only warns and silently reads row 0 for a bad id; recopt checks every
id (and that every per-id weight is finite) once per batch, before any lookup or update, and
raises naming the table, feature and id (or weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from recopt.modules.config import BaseEmbeddingConfig
from recopt.sparse import KeyedJaggedTensor


class InvalidIdError(ValueError):
    """An id outside ``[0, num_embeddings)`` of its table, or ids of a non-integer dtype."""


class NonFiniteWeightError(ValueError):
    """A per-id weight that is NaN or infinite."""


class FeatureLayout:
    """The features of a collection in lookup order (table order, then feature order)."""

    def __init__(self, tables: Sequence[BaseEmbeddingConfig]) -> None:
        self.feature_names: list[str] = []
        self.feature_table: list[int] = []
        for t, table in enumerate(tables):
            for feature in table.feature_names:
                self.feature_names.append(feature)
                self.feature_table.append(t)
        self.table_names = [tables[t].name for t in self.feature_table]
        self.num_rows = [tables[t].num_embeddings for t in self.feature_table]
        self.dims = [tables[t].embedding_dim for t in self.feature_table]
        # A feature looked up by several tables yields one output per table: "feature@table".
        shared = {f for f in self.feature_names if self.feature_names.count(f) > 1}
        self.output_keys = [
            f"{f}@{name}" if f in shared else f
            for f, name in zip(self.feature_names, self.table_names, strict=True)
        ]

    def prepare(
        self,
        features: KeyedJaggedTensor,
        is_weighted: bool,
        weight_dtype: torch.dtype = torch.float32,
    ) -> KeyedJaggedTensor:
        """Return ``features`` restricted to and ordered as this layout, with ids checked.

        The result is keyed by `output_keys`: a feature looked up by several tables appears
        once per table, as the virtual feature ``feature@table``, so its keys stay unique
        (every later step, sharded input distribution included, sees one feature per lookup).

        Per-id weights are converted to ``weight_dtype`` (the tables' dtype), as fbgemm
        does, so every backend accepts e.g. float64 weights alike.

        Raises:
            ValueError: a feature is missing, weights are missing / unexpected, or the
                input has a variable batch per feature (``regular_batch`` removes it).
            InvalidIdError: an id is outside its table, or the ids are not integers (bool,
                float: refused before anything is looked up).
            NonFiniteWeightError: a per-id weight is NaN or infinite (after the conversion
                to ``weight_dtype``).
        """
        features = self.select(features, is_weighted, weight_dtype)
        self.pending_check(features, clamp=False).raise_if_bad()
        return features

    def prepare_deferred(
        self,
        features: KeyedJaggedTensor,
        is_weighted: bool,
        weight_dtype: torch.dtype = torch.float32,
        selected: bool = False,
        raw_tables: Collection[str] = (),
    ) -> tuple[KeyedJaggedTensor, PendingCheck]:
        """`prepare`, with the id/weight check's answer left on the device.

        ``selected``: ``features`` already went through `select` (id maps rewrite them
        between the two); only the check runs. ``raw_tables``: id-mapped tables, whose
        features' raw ids (any int64) are neither checked nor clamped.

        The ids of the result are clamped into their tables (equal to the input's when the
        check passes), so they are safe to route before the answer is read; the caller reads
        ``bad`` later (the sharded module: in its count exchange) and must then call
        ``raise_error``.

        Raises:
            ValueError: as `prepare`, except the id and weight errors, which are deferred.
        """
        if not selected:
            features = self.select(features, is_weighted, weight_dtype)
        check = self.pending_check(features, clamp=True, raw_tables=raw_tables)
        if check.safe_values is not None:
            features = KeyedJaggedTensor(
                features.keys(),
                check.safe_values,
                weights=features.weights_or_none(),
                lengths=features.lengths(),
                offsets=features.offsets(),
                stride=features.stride(),
                length_per_key=features.length_per_key(),
            )
        return features, check

    def pending_check(
        self, features: KeyedJaggedTensor, clamp: bool, raw_tables: Collection[str] = ()
    ) -> PendingCheck:
        """`pending_id_check` of selected ``features`` against this layout's tables; the
        features of ``raw_tables`` are left out (checked as 0, kept as they are)."""
        values, bounds = features.values(), features.offset_per_key()
        raw = [
            (bounds[f], bounds[f + 1])
            for f, name in enumerate(self.table_names)
            if name in raw_tables and bounds[f + 1] > bounds[f]
        ]
        weights = features.weights_or_none()
        lengths = features.length_per_key()
        if raw and weights is None and sum(b - a for a, b in raw) == values.numel():
            require_integer_ids(values, self.feature_names, self.table_names)  # only raw ids
            names, rows = self.feature_names, self.num_rows
            return PendingCheck(None, None, values, lengths, names, self.table_names, rows, None)
        masked = values
        if raw:
            masked = values.clone()
            for a, b in raw:
                masked[a:b] = 0
        check = pending_id_check(
            masked,
            lengths,
            self.feature_names,
            self.table_names,
            self.num_rows,
            weights,
            clamp=clamp,
        )
        if raw and check.safe_values is not None:
            for a, b in raw:
                check.safe_values[a:b] = values[a:b]
        return check

    def select(
        self,
        features: KeyedJaggedTensor,
        is_weighted: bool,
        weight_dtype: torch.dtype = torch.float32,
    ) -> KeyedJaggedTensor:
        """`prepare` without the id/weight check (same ``ValueError`` otherwise)."""
        if features.variable_stride_per_key():
            raise ValueError(
                "the input has a variable batch per feature (stride_per_key_per_rank "
                f"{features.stride_per_key_per_rank()}); the embedding-bag modules need one "
                "batch size here: pass it through variable_batch.regular_batch first"
            )
        features = with_keys(select_features(features, self.feature_names), self.output_keys)
        has_weights = features.weights_or_none() is not None
        if is_weighted and not has_weights:
            raise ValueError(
                "the collection is weighted (is_weighted=True) but the input has no weights"
            )
        if has_weights and not is_weighted:
            raise ValueError(
                "the input carries per-id weights but the collection was built with "
                "is_weighted=False; build it with is_weighted=True or drop the weights"
            )
        weights = features.weights_or_none()
        if weights is not None and weights.dtype != weight_dtype:
            features = KeyedJaggedTensor.from_offsets_sync(
                features.keys(),
                features.values(),
                features.offsets(),
                weights=weights.to(weight_dtype),
                stride=features.stride(),
            )
        return features


def require_features(keys: Sequence[str], names: Sequence[str]) -> None:
    """Check that the input's ``keys`` hold every feature of ``names``.

    Raises:
        ValueError: naming the features the input lacks, its keys and the collection's.
    """
    present = set(keys)
    wanted = list(dict.fromkeys(names))  # a feature shared by tables once
    missing = [f for f in wanted if f not in present]
    if missing:
        raise ValueError(
            f"input is missing features {missing}; it has {list(keys)}, the collection "
            f"looks up {wanted}"
        )


def require_integer_ids(
    values: torch.Tensor, feature_names: Sequence[str], table_names: Sequence[str]
) -> None:
    """Refuse ids of a non-integer dtype (a dtype check: no host sync).

    Bool ids would pass the lookup as 0/1 and fail in the optimizer's backward (after its
    step counters moved); float ids fail inside torch with an error naming neither table nor
    feature. All features share one ids tensor, so all are named.

    Raises:
        InvalidIdError: naming the dtype, the first table and feature, and the fix.
    """
    dtype = values.dtype
    bad = dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
    if bad and feature_names:
        pairs = [f"{f!r} (table {t!r})" for f, t in zip(feature_names, table_names, strict=True)]
        more = f" and {len(pairs) - 3} more" if len(pairs) > 3 else ""
        raise InvalidIdError(
            f"table {table_names[0]!r}, feature {feature_names[0]!r}: ids are of dtype {dtype}, "
            f"not integers (features {', '.join(pairs[:3])}{more} share this ids tensor); "
            "give int64 (or int32) row ids, e.g. map the raw values to rows and call .long() "
            "(nothing was updated)."
        )


def select_features(features: KeyedJaggedTensor, names: Sequence[str]) -> KeyedJaggedTensor:
    """``features`` restricted to and ordered as ``names`` (a shared feature repeated).

    Raises:
        ValueError: naming the features the input lacks.
    """
    keys = features.keys()
    if keys == list(names):
        return features
    require_features(keys, names)
    index = {k: i for i, k in enumerate(keys)}
    return features.permute([index[f] for f in names])


def with_keys(features: KeyedJaggedTensor, keys: Sequence[str]) -> KeyedJaggedTensor:
    """``features`` (already selected and ordered, keys possibly repeated) renamed to ``keys``.

    A feature looked up by several tables is repeated by the selection; renaming each copy to
    its output key (``feature@table``) gives unique keys, which any later rebuild of the KJT
    needs. Ids, weights, lengths and batch sizes are kept (``inverse_indices`` are not: they
    name the old keys); ``features`` itself is returned when its keys already are ``keys``.
    """
    if features.keys() == list(keys):
        return features
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        list(keys),
        features.values(),
        weights=features.weights_or_none(),
        lengths=features.lengths(),
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        length_per_key=features.length_per_key(),
    )


def check_ids_in_range(
    values: torch.Tensor,
    length_per_key: Sequence[int],
    feature_names: Sequence[str],
    table_names: Sequence[str],
    num_rows: Sequence[int],
    weights: torch.Tensor | None = None,
) -> None:
    """Raise if any feature's ids fall outside its table or any per-id weight is not finite.

    One comparison covers every feature (and every weight) at once, and only its single yes/no
    answer is read back to the host (one sync per call on a GPU, not two per feature); the slow
    per-feature pass that names the culprit runs only when something is bad.

    Args:
        values: all ids, feature-major (KJT layout).
        length_per_key: number of ids of each feature.
        feature_names: the features, in the order of ``values``.
        table_names: the table each feature looks up.
        num_rows: the row count of each feature's table.
        weights: the per-id weights, aligned with ``values``; ``None`` when unweighted.

    Raises:
        InvalidIdError: naming the table, the feature, the offending id and the valid range.
        NonFiniteWeightError: naming the table, the feature and the NaN or infinite weight.
    """
    pending_id_check(
        values, length_per_key, feature_names, table_names, num_rows, weights
    ).raise_if_bad()


@dataclass(frozen=True, slots=True)
class PendingCheck:
    """The id/weight check of one batch, its yes/no answer still on the device.

    ``bad``: a 0-dim bool tensor, true when an id is out of range or a weight not finite
    (``None``: no ids, nothing to check). ``safe_values``: the ids clamped into their tables
    (``None`` unless asked for).
    """

    bad: torch.Tensor | None
    safe_values: torch.Tensor | None
    values: torch.Tensor
    length_per_key: Sequence[int]
    feature_names: Sequence[str]
    table_names: Sequence[str]
    num_rows: Sequence[int]
    weights: torch.Tensor | None

    def raise_if_bad(self) -> None:
        """Read the answer back (one host sync) and raise naming the culprit if it is bad."""
        if self.bad is not None and self.bad:  # the one host sync of the check
            self.raise_error()

    def raise_error(self) -> NoReturn:
        """The slow pass of a failed check: raise naming the table, feature and id (weight)."""
        _raise_first_bad_id(
            self.values, self.length_per_key, self.feature_names, self.table_names, self.num_rows
        )
        if self.weights is not None:
            _raise_first_bad_weight(
                self.weights, self.length_per_key, self.feature_names, self.table_names
            )
        raise AssertionError("the check failed but no feature holds the cause")  # invariant


def pending_id_check(
    values: torch.Tensor,
    length_per_key: Sequence[int],
    feature_names: Sequence[str],
    table_names: Sequence[str],
    num_rows: Sequence[int],
    weights: torch.Tensor | None = None,
    clamp: bool = False,
) -> PendingCheck:
    """`check_ids_in_range` without reading its answer back (no host sync).

    Args:
        values, length_per_key, feature_names, table_names, num_rows, weights: as
            `check_ids_in_range`.
        clamp: also return the ids clamped into their tables (one more pass over the ids), so
            that they can be routed before the answer is known.

    Raises:
        InvalidIdError: the ids are not integers (`require_integer_ids`), raised at once.
    """
    require_integer_ids(values, feature_names, table_names)
    total = sum(length_per_key)
    check = PendingCheck(
        None, None, values, length_per_key, feature_names, table_names, num_rows, weights
    )
    if total == 0:
        return check
    device = values.device
    limits = torch.tensor(list(num_rows), dtype=torch.int64).to(device, non_blocking=True)
    repeats = torch.tensor(list(length_per_key), dtype=torch.int64).to(device, non_blocking=True)
    # output_size makes repeat_interleave size its result without reading ``repeats`` back.
    limit_per_id = torch.repeat_interleave(limits, repeats, output_size=total)
    ids = values[:total]
    safe: torch.Tensor | None = None
    if clamp:
        safe = torch.minimum(ids.clamp(min=0), limit_per_id - 1)
        bad = (safe != ids).any()
        safe = safe if total == values.numel() else torch.cat([safe, values[total:]])
    else:
        bad = torch.logical_or(ids < 0, ids >= limit_per_id).any()
    if weights is not None:
        bad = torch.logical_or(bad, ~torch.isfinite(weights[:total]).all())
    return dataclasses.replace(check, bad=bad, safe_values=safe)


def _raise_first_bad_id(
    values: torch.Tensor,
    length_per_key: Sequence[int],
    feature_names: Sequence[str],
    table_names: Sequence[str],
    num_rows: Sequence[int],
) -> None:
    """Raise naming the first feature with an id outside its table, if any (error path)."""
    start = 0
    for i, count in enumerate(length_per_key):
        if count:
            low, high = torch.aminmax(values[start : start + count])
            lo, hi = int(low), int(high)
            if lo < 0 or hi >= num_rows[i]:
                bad = lo if lo < 0 else hi
                raise InvalidIdError(
                    f"table {table_names[i]!r}, feature {feature_names[i]!r}: id {bad} is out of "
                    f"range; valid ids are 0..{num_rows[i] - 1}. Hash or clip ids into the table "
                    "before lookup (nothing was updated)."
                )
        start += count


def _raise_first_bad_weight(
    weights: torch.Tensor,
    length_per_key: Sequence[int],
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> None:
    """Raise naming the first feature with a NaN or infinite weight, if any (error path)."""
    start = 0
    for i, count in enumerate(length_per_key):
        bad = (~torch.isfinite(weights[start : start + count])).nonzero()
        if bad.numel():
            position = int(bad[0, 0])
            raise NonFiniteWeightError(
                f"table {table_names[i]!r}, feature {feature_names[i]!r}: per-id weight "
                f"{float(weights[start + position])} (entry {position} of the feature) is NaN "
                "or infinite; weights must be finite. Clean or clip the weights before lookup "
                "(nothing was updated)."
            )
        start += count
