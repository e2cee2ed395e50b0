"""Complete validation of a sharding plan against its tables, ranks and hosts.

Pure and deterministic: every rank reaches the same verdict before the first collective, and the
error names the module, the table, the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recopt.kernels.config import Backend
from recopt.sharding.plan import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardSpec,
    TableLike,
    check_world,
    table_names,
)
from recopt.sharding.sharding_types import ShardingType, sharding_spec


def validate_plan(
    plan: ShardingPlan,
    tables_by_module: Mapping[str, Sequence[TableLike]],
    world_size: int,
    ranks_per_host: int | None = None,
) -> None:
    """Check a plan completely against its tables and ranks.

    Args:
        plan: the plan.
        tables_by_module: module path -> the module's tables.
        world_size: number of ranks.
        ranks_per_host: ranks per host (default: ``world_size``); host of rank r is r // it.

    Raises:
        PlanError: the first problem found, naming the module, the table and the fix; among
            them an id-mapped table sharded so that a row has more than one owner (column
            shards, replicas: `id_map_refusal`).
    """
    rph = check_world(world_size, ranks_per_host)
    unknown_modules = sorted(set(plan.plan) - set(tables_by_module))
    if unknown_modules:
        raise PlanError(
            f"plan names unknown modules {unknown_modules}; modules with tables: "
            f"{sorted(tables_by_module)}"
        )
    for module, tables in tables_by_module.items():
        names = table_names(tables, module)
        shardings = plan.get(module)
        if shardings is None:
            raise PlanError(f"module {module!r}: the plan has no entry for it; tables: {names}")
        unknown = sorted(set(shardings) - set(names))
        if unknown:
            raise PlanError(
                f"module {module!r}: plan names unknown tables {unknown}; tables: {sorted(names)}"
            )
        for t in tables:
            if t.name not in shardings:
                raise PlanError(
                    f"table {t.name!r} (module {module!r}): not in the plan; "
                    "every table needs a sharding"
                )
            _validate_table(
                shardings[t.name], t, f"table {t.name!r} (module {module!r})", world_size, rph
            )


def _validate_table(
    ps: ParameterSharding, table: TableLike, where: str, world_size: int, rph: int
) -> None:
    rows, dim = table.num_embeddings, table.embedding_dim
    bad = [r for r in (*ps.ranks, *(s.rank for s in ps.shards)) if not 0 <= r < world_size]
    if bad:
        raise PlanError(f"{where}: rank {bad[0]} does not exist; ranks are 0..{world_size - 1}")
    check_id_map_sharding(ps, table, where)
    if ps.sharding_type.replicated:
        if ps.shards or ps.ranks != tuple(range(world_size)):
            raise PlanError(
                f"{where}: data_parallel must have no shards and ranks 0..{world_size - 1}"
                f" (a replica on every rank); got ranks {list(ps.ranks)} and "
                f"{len(ps.shards)} shards"
            )
        _check_kernel_width(ps, [dim], where)
        return
    if not ps.shards:
        raise PlanError(f"{where}: {ps.sharding_type.value} sharding has no shards")
    for s in ps.shards:
        if s.num_rows < 1 or s.num_cols < 1:
            raise PlanError(f"{where}: empty shard {_rect(s)} on rank {s.rank}; drop it")
        if (
            s.row_offset < 0
            or s.col_offset < 0
            or s.row_offset + s.num_rows > rows
            or (s.col_offset + s.num_cols > dim)
        ):
            raise PlanError(
                f"{where}: shard {_rect(s)} on rank {s.rank} is outside the table "
                f"(rows 0..{rows}, columns 0..{dim})"
            )
    shard_ranks = tuple(sorted({s.rank for s in ps.shards}))
    if ps.ranks != shard_ranks:
        raise PlanError(
            f"{where}: ranks {list(ps.ranks)} must equal the shards' ranks "
            f"{list(shard_ranks)}, ascending and distinct"
        )
    _check_type_layout(ps, rows, dim, where, rph)
    if ps.sharding_type.splits_columns:
        _check_tiling([(s.col_offset, s.num_cols) for s in ps.shards], dim, "columns", where)
    else:
        _check_tiling([(s.row_offset, s.num_rows) for s in ps.shards], rows, "rows", where)
    _check_kernel_width(ps, [s.num_cols for s in ps.shards], where)


def id_map_types() -> list[ShardingType]:
    """The sharding types an id-mapped table may have: those that give each row one owner."""
    return [k for k in ShardingType if k.one_owner_per_row]


def _id_map_types_text() -> str:
    names = [k.value for k in id_map_types()]
    return f"{', '.join(names[:-1])} or {names[-1]}" if names[1:] else names[0]


def id_map_refusal(kind: ShardingType) -> str:
    """Why an id-mapped table cannot be sharded ``kind``; ``""`` when it can.

    A table's id map sends each raw id to one row, and the rank that owns the row keeps the
    map of its rows. A type that cuts a row across ranks (column shards) or copies it to every
    rank (replicas) would need the whole map on each of those ranks, kept equal: refused.
    """
    if kind.one_owner_per_row:
        return ""
    what = (
        "puts a replica of every row on every rank"
        if kind.replicated
        else "splits each row's columns over ranks"
    )
    return (
        f"sharding type {kind.value} cannot hold an id-mapped table: one map per table needs "
        f"one owner per row, but {kind.value} {what}, and each of those ranks would need the "
        f"whole map; shard it {_id_map_types_text()}, or drop its id_map"
    )


def check_id_map_type(kind: ShardingType, table: TableLike, where: str) -> None:
    """Refuse sharding type ``kind`` for ``table`` if the table is id-mapped and the type is one
    `id_map_refusal` refuses (before any layout is cut for it).

    Raises:
        PlanError: naming ``where`` (the table and module), the type, why and the fix.
    """
    refusal = id_map_refusal(kind) if getattr(table, "id_map", None) is not None else ""
    if refusal:
        raise PlanError(f"{where}: {refusal}")


def check_id_map_sharding(ps: ParameterSharding, table: TableLike, where: str) -> None:
    """Refuse a sharding of an id-mapped table that does not give each row one owner: a type
    that `id_map_refusal` refuses, or shards that do not span every column.

    Raises:
        PlanError: naming ``where`` (the table and module), the type, why and the fix.
    """
    if getattr(table, "id_map", None) is None:
        return
    check_id_map_type(ps.sharding_type, table, where)
    dim = table.embedding_dim
    for s in ps.shards:
        if s.col_offset != 0 or s.num_cols != dim:
            raise PlanError(
                f"{where}: an id-mapped table needs one owner per row, but its "
                f"{ps.sharding_type.value} shard {_rect(s)} on rank {s.rank} splits the "
                f"columns (0..{dim}); shard it {_id_map_types_text()} with every shard "
                "spanning all columns, or drop its id_map"
            )


def _check_type_layout(ps: ParameterSharding, rows: int, dim: int, where: str, rph: int) -> None:
    kind = ps.sharding_type
    spec = sharding_spec(kind)
    if spec.one_shard and len(ps.shards) != 1:
        raise PlanError(
            f"{where}: {kind.value} needs exactly one shard (the whole table), got "
            f"{len(ps.shards)}; use row_wise or column_wise to split it"
        )
    if not spec.splits_columns:
        for s in ps.shards:
            if s.col_offset != 0 or s.num_cols != dim:
                raise PlanError(
                    f"{where}: {kind.value} shards span every column (0..{dim}); "
                    f"shard {_rect(s)} on rank {s.rank} does not"
                )
    if not spec.splits_rows:
        for s in ps.shards:
            if s.row_offset != 0 or s.num_rows != rows:
                raise PlanError(
                    f"{where}: {kind.value} shards span every row (0..{rows}); "
                    f"shard {_rect(s)} on rank {s.rank} does not"
                )
    if kind.splits_rows and len(ps.ranks) != len(ps.shards):
        raise PlanError(
            f"{where}: {kind.value} puts at most one row range on a rank; "
            f"{len(ps.shards)} shards on ranks {list(ps.ranks)}"
        )
    if kind.host_local:
        hosts = sorted({r // rph for r in ps.ranks})
        if len(hosts) > 1:
            raise PlanError(
                f"{where}: {kind.value} keeps a table inside one host, but its ranks "
                f"{list(ps.ranks)} span hosts {hosts} ({rph} ranks per host); "
                f"use {'row_wise' if kind.splits_rows else 'column_wise'} instead"
            )


def _check_tiling(spans: list[tuple[int, int]], extent: int, axis: str, where: str) -> None:
    covered = 0
    for start, size in sorted(spans):
        if start > covered:
            raise PlanError(f"{where}: {axis} {covered}..{start} have no shard")
        if start < covered:
            raise PlanError(
                f"{where}: shards overlap on {axis} {start}..{min(covered, start + size)}"
            )
        covered = start + size
    if covered < extent:
        raise PlanError(
            f"{where}: shards cover {axis} 0..{covered} of {extent}; "
            f"{axis} {covered}..{extent} have no shard"
        )


def _check_kernel_width(ps: ParameterSharding, widths: list[int], where: str) -> None:
    # The fbgemm table-batched kernels require widths that are multiples of 4; recopt's own
    # kernel (and AUTO, which falls back to it) takes any width.
    if ps.backend is Backend.FBGEMM:
        odd = [w for w in widths if w % 4]
        if odd:
            raise PlanError(
                f"{where}: shard width {odd[0]} is not a multiple of 4, which the "
                "fbgemm kernel requires; use backend 'auto' or 'recopt', or "
                "column shards whose widths are multiples of 4"
            )


def _rect(s: ShardSpec) -> str:
    return (
        f"rows {s.row_offset}..{s.row_offset + s.num_rows}, "
        f"columns {s.col_offset}..{s.col_offset + s.num_cols}"
    )
