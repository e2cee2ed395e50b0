"""Writing a sharding plan by hand: per-table requests resolved against each table's shape.

`row_wise()`, `table_wise(3)`, ... make a `ShardingRequest`; `construct_module_sharding_plan`
lays the requests out on a module's tables and validates the result. `balanced_table_wise_plan`
is the default when no planner runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.placement import DEVICE, Placement
from recopt.sharding.plan import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingType,
    TableLike,
    check_world,
    table_names,
)
from recopt.sharding.plan_validation import check_id_map_type, validate_plan
from recopt.sharding.sharding_types import ShardSpec, sharding_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingRequest:
    """A sharding chosen by hand, before it is resolved against a table's shape.

    Made by `table_wise`, `row_wise`, `column_wise`, `table_row_wise`, `table_column_wise` and
    `data_parallel`; turned into a `ParameterSharding` by `construct_module_sharding_plan`.

    Args:
        sharding_type: the strategy.
        ranks: explicit ranks (table-wise: one; row-wise: ``None`` for all; column-wise: in
            column order, repeats allowed).
        host: the host for the table-row-wise and table-column-wise types.
        backend: the kernel backend.
        optimizer: a per-table fused optimizer, or ``None`` for the module's.
        placement: where the table's shards live on their ranks (CUDA only for UVM).
    """

    sharding_type: ShardingType
    ranks: tuple[int, ...] | None = None
    host: int | None = None
    backend: Backend = Backend.AUTO
    optimizer: FusedOptimizerConfig | None = None
    placement: Placement = DEVICE

    def __post_init__(self) -> None:
        if sharding_spec(self.sharding_type).one_shard and (
            self.ranks is None or len(self.ranks) != 1
        ):
            raise PlanError(
                f"ShardingRequest(sharding_type={self.sharding_type}) needs exactly one rank, got "
                f"ranks={self.ranks}; pass ranks=(r,) or use table_wise(r)"
            )

    def resolve(
        self,
        table: TableLike,
        world_size: int,
        ranks_per_host: int | None = None,
        *,
        module_path: str = "",
    ) -> ParameterSharding:
        """Lay the request out on ``table`` (of module ``module_path``, named in errors).

        Raises:
            PlanError: the layout is impossible (e.g. columns that cannot be split evenly).
        """
        rph = check_world(world_size, ranks_per_host)
        spec = sharding_spec(self.sharding_type)
        where = f"table {table.name!r} (module {module_path!r})"
        ranks: Sequence[int]
        if spec.replicated:
            ranks = range(world_size)
        elif spec.one_shard:
            assert self.ranks is not None  # checked in __post_init__
            ranks = self.ranks
        else:
            ranks = self._ranks_or_host(world_size, rph, where)
        shards: list[ShardSpec] = []
        if not spec.replicated:
            sizes = spec.cut(table.num_embeddings, table.embedding_dim, len(ranks), where)
            shards = spec.place(sizes, ranks)
        if shards:
            ranks = sorted({s.rank for s in shards})
        return ParameterSharding(
            sharding_type=self.sharding_type,
            ranks=tuple(ranks),
            shards=tuple(shards),
            backend=self.backend,
            optimizer=self.optimizer,
            placement=self.placement,
        )

    def _ranks_or_host(self, world_size: int, rph: int, where: str) -> Sequence[int]:
        if self.host is not None:
            num_hosts = -(-world_size // rph)
            if not 0 <= self.host < num_hosts:
                raise PlanError(
                    f"{where}: host {self.host} does not exist; world size {world_size} with "
                    f"{rph} ranks per host has hosts 0..{num_hosts - 1}"
                )
            return range(self.host * rph, min(world_size, (self.host + 1) * rph))
        if self.ranks is not None and not self.ranks:
            raise PlanError(f"{where}: {self.sharding_type.value} needs at least one rank, got []")
        return range(world_size) if self.ranks is None else self.ranks


def table_wise(
    rank: int,
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """The whole table on ``rank``."""
    return ShardingRequest(
        sharding_type=ShardingType.TABLE_WISE,
        ranks=(rank,),
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def row_wise(
    ranks: Sequence[int] | None = None,
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """Row ranges over ``ranks`` (all ranks by default), the first ``rows % n`` one row larger.

    A table with fewer rows than ranks puts no shard on the extra ranks.
    """
    return ShardingRequest(
        sharding_type=ShardingType.ROW_WISE,
        ranks=None if ranks is None else tuple(ranks),
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def column_wise(
    ranks: Sequence[int],
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """Column ranges in the given rank order, a rank possibly several times; see `split_columns`."""
    return ShardingRequest(
        sharding_type=ShardingType.COLUMN_WISE,
        ranks=tuple(ranks),
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def table_row_wise(
    host: int,
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """Row ranges over the ranks of one host, split as in `row_wise`."""
    return ShardingRequest(
        sharding_type=ShardingType.TABLE_ROW_WISE,
        host=host,
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def table_column_wise(
    host: int,
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """Column ranges over the ranks of one host, one per rank, split as in `column_wise`."""
    return ShardingRequest(
        sharding_type=ShardingType.TABLE_COLUMN_WISE,
        host=host,
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def data_parallel(
    *,
    backend: Backend = Backend.AUTO,
    optimizer: FusedOptimizerConfig | None = None,
    placement: Placement = DEVICE,
) -> ShardingRequest:
    """A full replica on every rank; gradients are all-reduced."""
    return ShardingRequest(
        sharding_type=ShardingType.DATA_PARALLEL,
        backend=backend,
        optimizer=optimizer,
        placement=placement,
    )


def construct_module_sharding_plan(
    tables: Sequence[TableLike],
    per_table: Mapping[str, ShardingRequest],
    world_size: int,
    ranks_per_host: int | None = None,
    *,
    module_path: str = "",
) -> dict[str, ParameterSharding]:
    """Resolve one module's hand-written requests against its tables, and validate them.

    Args:
        tables: the module's tables.
        per_table: table name -> request (from `row_wise()` etc.); must cover every table.
        world_size: number of ranks.
        ranks_per_host: ranks per host (default: ``world_size``, a single host).
        module_path: the module's path, for error messages.

    Returns:
        Table name -> `ParameterSharding`, ready for ``ShardingPlan({module_path: ...})``.

    Raises:
        PlanError: a table without a request, a request for an unknown table, an invalid
            layout, or a type an id-mapped table cannot have (column-wise, data-parallel).
    """
    names = table_names(tables, module_path)
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise PlanError(
            f"module {module_path!r}: requests for unknown tables {unknown}; "
            f"tables: {sorted(names)}"
        )
    result: dict[str, ParameterSharding] = {}
    for t in tables:
        if t.name not in per_table:
            raise PlanError(f"table {t.name!r} (module {module_path!r}): no sharding requested")
        request = per_table[t.name]
        # Before the layout is cut: a column split the table's width does not allow would
        # otherwise hide that the type is refused for an id-mapped table anyway.
        check_id_map_type(request.sharding_type, t, f"table {t.name!r} (module {module_path!r})")
        result[t.name] = request.resolve(t, world_size, ranks_per_host, module_path=module_path)
    validate_plan(
        ShardingPlan({module_path: result}), {module_path: tables}, world_size, ranks_per_host
    )
    return result


def balanced_table_wise_plan(
    tables_by_module: Mapping[str, Sequence[TableLike]], world_size: int
) -> ShardingPlan:
    """Every table whole on one rank, greedily balancing parameter count (largest table first).

    Args:
        tables_by_module: module path -> its tables.
        world_size: number of ranks.

    Returns:
        A table-wise plan; ties go to the lowest rank, so every rank computes the same plan.
    """
    check_world(world_size, None)
    load = [0] * world_size
    items = [(m, t) for m, ts in tables_by_module.items() for t in ts]
    items.sort(key=lambda mt: (-mt[1].num_embeddings * mt[1].embedding_dim, mt[0], mt[1].name))
    plan: dict[str, dict[str, ParameterSharding]] = {m: {} for m in tables_by_module}
    for module, t in items:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += t.num_embeddings * t.embedding_dim
        plan[module][t.name] = table_wise(rank).resolve(t, world_size)
    return ShardingPlan(plan)
