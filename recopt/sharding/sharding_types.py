"""Sharding types: one frozen `ShardingSpec` per `ShardingType`, holding every fact about it.

A spec holds the type's traits (which axis it splits, whether its ranks stay on one host,
whether every rank holds a replica) and the one function that cuts a table into its shards
(`ShardingSpec.cut`); the hand-written plans (`plan_helpers`), the planner's enumerator,
estimates and validation read the spec and never test a type by name. Adding a sharding type is
a `ShardingType` member, its spec in `SHARDING_SPECS`, and tests; a type without a spec is an
error wherever it is used (`sharding_spec`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class PlanError(ValueError):
    """A sharding plan is malformed, incomplete or does not fit the tables and ranks it is for."""


class ShardingType(enum.StrEnum):
    """How one table is split over ranks; its facts are its `ShardingSpec` (`spec`)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"

    @property
    def spec(self) -> ShardingSpec:
        """This type's spec (`sharding_spec`)."""
        return sharding_spec(self)

    @property
    def splits_rows(self) -> bool:
        """Shards are row ranges of the full width (row-wise, table-row-wise)."""
        return self.spec.splits_rows

    @property
    def splits_columns(self) -> bool:
        """Shards are column ranges of the full height (column-wise, table-column-wise)."""
        return self.spec.splits_columns

    @property
    def host_local(self) -> bool:
        """All shards of a table stay on the ranks of one host (the table-* types)."""
        return self.spec.host_local

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole table (data-parallel)."""
        return self.spec.replicated

    @property
    def whole_table(self) -> bool:
        """Each rank that holds the table sees all its rows and columns (table-wise, DP)."""
        return self.spec.whole_table

    @property
    def one_owner_per_row(self) -> bool:
        """Each row lives whole on exactly one rank (table-wise, row-wise, table-row-wise)."""
        return self.spec.one_owner_per_row


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    """One rectangle of a table placed on one rank.

    Args:
        rank: the rank that stores the rectangle.
        row_offset: first row of the rectangle in the full table.
        num_rows: number of rows.
        col_offset: first column in the full table.
        num_cols: number of columns (the width the kernel sees).
    """

    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


# (rows, dim, parts, where) -> (rows, cols) of each shard, in order along the split axis.
CutFn = Callable[[int, int, int, str], list[tuple[int, int]]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingSpec:
    """Every fact about one sharding type.

    Args:
        sharding_type: the type this spec describes.
        splits_rows: shards are row ranges of the full width; a rank holds at most one.
        splits_columns: shards are column ranges of the full height; a rank may hold several.
        host_local: all shards of a table stay on the ranks of one host.
        replicated: every rank holds the whole table (no shards; gradients all-reduced).
        cut: ``(rows, dim, parts, where) -> [(rows, cols), ...]``, the table cut into at most
            ``parts`` shards along the type's axis (``where`` names the table in errors).
    """

    sharding_type: ShardingType
    splits_rows: bool = False
    splits_columns: bool = False
    host_local: bool = False
    replicated: bool = False
    cut: CutFn

    def __post_init__(self) -> None:
        if self.splits_rows and self.splits_columns:
            raise ValueError(f"{self.sharding_type}: a spec splits rows or columns, not both")
        if self.replicated and (self.splits_rows or self.splits_columns or self.host_local):
            raise ValueError(f"{self.sharding_type}: a replicated type does not split the table")

    @property
    def whole_table(self) -> bool:
        """Each rank that holds the table sees all its rows and columns (table-wise, DP)."""
        return not (self.splits_rows or self.splits_columns)

    @property
    def one_shard(self) -> bool:
        """The table is one shard on one rank (table-wise)."""
        return self.whole_table and not self.replicated

    @property
    def one_owner_per_row(self) -> bool:
        """Each row lives whole on exactly one rank (table-wise, row-wise, table-row-wise):
        neither cut across its columns nor replicated. An id-mapped table needs it
        (`plan_validation.id_map_refusal`)."""
        return not (self.splits_columns or self.replicated)

    def place(self, sizes: Sequence[tuple[int, int]], ranks: Sequence[int]) -> list[ShardSpec]:
        """Shard ``i`` of ``sizes`` (from `cut`) on ``ranks[i]``, offsets along the split axis.

        A row split may leave ranks without a shard (fewer rows than ranks): the extra ranks at
        the end get none.
        """
        if len(sizes) > len(ranks):
            raise PlanError(f"{self.sharding_type.value}: {len(sizes)} shards for ranks {ranks}")
        shards, offset = [], 0
        for (rows, cols), rank in zip(sizes, ranks, strict=False):
            if self.splits_columns:
                shards.append(
                    ShardSpec(
                        rank=rank, row_offset=0, num_rows=rows, col_offset=offset, num_cols=cols
                    )
                )
                offset += cols
            else:
                shards.append(
                    ShardSpec(
                        rank=rank, row_offset=offset, num_rows=rows, col_offset=0, num_cols=cols
                    )
                )
                offset += rows
        return shards


def split_evenly(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def split_columns(dim: int, parts: int, where: str = "table") -> list[int]:
    """Column widths for ``parts`` column shards of a ``dim``-wide table.

    Equal widths that are multiples of 4 when ``dim`` allows it; otherwise multiples of 4 as equal
    as possible (wider first) when ``dim`` is a multiple of 4 and at least ``4 * parts``;
    otherwise equal widths when ``parts`` divides ``dim``.

    Raises:
        PlanError: none of these is possible.
    """
    if dim % (4 * parts) == 0:
        return [dim // parts] * parts
    if dim % 4 == 0 and dim >= 4 * parts:
        return [4 * b for b in split_evenly(dim // 4, parts)]
    if dim % parts == 0:
        return [dim // parts] * parts
    raise PlanError(
        f"{where}: embedding_dim {dim} cannot be split into {parts} column shards of equal width "
        f"or of widths that are multiples of 4; use a number of shards that divides {dim}"
    )


def _whole(rows: int, dim: int, parts: int, where: str) -> list[tuple[int, int]]:
    return [(rows, dim)]


def _row_ranges(rows: int, dim: int, parts: int, where: str) -> list[tuple[int, int]]:
    return [(n, dim) for n in split_evenly(rows, parts) if n > 0]


def _column_ranges(rows: int, dim: int, parts: int, where: str) -> list[tuple[int, int]]:
    return [(rows, n) for n in split_columns(dim, parts, where)]


_T = ShardingType
SHARDING_SPECS: dict[ShardingType, ShardingSpec] = {
    s.sharding_type: s
    for s in (
        ShardingSpec(sharding_type=_T.DATA_PARALLEL, replicated=True, cut=_whole),
        ShardingSpec(sharding_type=_T.TABLE_WISE, cut=_whole),
        ShardingSpec(sharding_type=_T.ROW_WISE, splits_rows=True, cut=_row_ranges),
        ShardingSpec(sharding_type=_T.COLUMN_WISE, splits_columns=True, cut=_column_ranges),
        ShardingSpec(
            sharding_type=_T.TABLE_ROW_WISE, splits_rows=True, host_local=True, cut=_row_ranges
        ),
        ShardingSpec(
            sharding_type=_T.TABLE_COLUMN_WISE,
            splits_columns=True,
            host_local=True,
            cut=_column_ranges,
        ),
    )
}


def sharding_spec(kind: ShardingType | str) -> ShardingSpec:
    """The spec of a sharding type (or its name).

    Raises:
        PlanError: the name is no sharding type, or the type has no spec in `SHARDING_SPECS`.
    """
    known = sorted(s.value for s in SHARDING_SPECS)
    try:
        return SHARDING_SPECS[ShardingType(kind)]
    except (KeyError, ValueError):
        raise PlanError(
            f"sharding_type {str(kind)!r} has no ShardingSpec; known types: {known} "
            "(a new type needs its spec in recopt/sharding/sharding_types.py)"
        ) from None
