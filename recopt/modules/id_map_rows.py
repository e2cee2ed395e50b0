"""The rows an id map hands out: fresh rows' initial values and reset, and each id's owner shard.

A row given to a new id is re-initialised from a hash of (raw id, step, column) (`hash_uniform`:
the same draw whatever layout or rank holds the row) and its per-row optimizer state zeroed;
`reset_fresh_tables` does that for all of a collection's tables at once (one native call for
the float32 CPU tables), after telling the maps' observers. `route_shard` names the row shard
that owns a raw id of a sharded table (a hash of the id alone).
Legend: M ids, K fresh rows, D row width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from recopt.kernels import cpu_id_map
from recopt.kernels.registry import StateShape, optimizer_spec
from recopt.modules.config import BaseEmbeddingConfig
from recopt.modules.id_map_results import Remapped, to_device

if TYPE_CHECKING:
    from recopt.modules.id_map_lookup import IdMaps


def init_rows(table: BaseEmbeddingConfig, weight: torch.Tensor, fresh: Remapped, step: int) -> None:
    """Re-initialise ``weight``'s fresh rows (in place) with the table's initialisation.

    Uniform tables draw from a hash of (raw id, step, column), so a row gets the same values
    wherever it lives; an ``init_fn`` is called on a new ``[K, D]`` tensor (torch's RNG).
    """
    rows = fresh.fresh_rows
    if rows.numel() == 0:
        return
    with torch.no_grad():
        if table.init_fn is not None:
            values = torch.empty(
                rows.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device
            )
            table.init_fn(values)
        else:
            lo, hi = table.init_bounds()
            if cpu_id_map.fill_uniform(weight, rows, fresh.fresh_ids, step, lo, hi):
                return  # native: the same values, written in place
            unit = hash_uniform(fresh.fresh_ids, step, weight.shape[1])
            values = lo + (hi - lo) * unit
        weight[rows] = values.to(weight.dtype)


def reset_state_rows(
    optimizer_name: str, states: Mapping[str, torch.Tensor], rows: torch.Tensor
) -> None:
    """Zero every per-row optimizer state of ``rows`` (per-column and scalar states stay)."""
    if rows.numel() == 0:
        return
    with torch.no_grad():
        for state in row_states(optimizer_name, states):
            state[rows] = 0


def row_states(optimizer_name: str, states: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The per-row and per-element states of ``states`` (those a fresh row zeroes and a
    relocated row carries), in the optimizer's state order."""
    shapes = dict(optimizer_spec(optimizer_name).states)
    row_shapes = (StateShape.PER_ROW, StateShape.PER_ELEMENT)
    return [states[key] for key, shape in shapes.items() if shape in row_shapes]


@dataclass(frozen=True, slots=True)
class ResetRoute:
    """How a table's fresh rows are reset, fixed by its config, weight and states (worked
    out once per table where its owner keeps it: `ResetTarget`): ``way`` "device" (uniform
    init on a GPU: hashed with the other such tables), "native" (uniform init, float32 on
    CPU: `cpu_id_map.reset_many`) or "each" (`init_rows` and `reset_state_rows`); ``zeroed``
    the per-row states; ``lo``, ``hi`` the init bounds; ``native`` the native call's part
    that stays the same every step (way "native" only)."""

    way: str
    zeroed: list[torch.Tensor]
    lo: float
    hi: float
    native: cpu_id_map.ResetTable | None = None


class ResetTarget(NamedTuple):
    """A table whose fresh rows a collection resets: its config, optimizer, ``weight`` (the
    table or a shard of it) and optimizer ``states``, and its `ResetRoute`."""

    table: BaseEmbeddingConfig
    optimizer_name: str
    weight: torch.Tensor
    states: Mapping[str, torch.Tensor]
    route: ResetRoute

    @staticmethod
    def of(
        table: BaseEmbeddingConfig,
        optimizer_name: str,
        weight: torch.Tensor,
        states: Mapping[str, torch.Tensor],
    ) -> ResetTarget:
        """The target of ``table``, its route worked out now."""
        zeroed = row_states(optimizer_name, states)
        if table.init_fn is None and weight.device.type != "cpu":
            way = "device"
        elif table.init_fn is None and cpu_id_map.can_reset(weight, zeroed):
            way = "native"
        else:
            way = "each"
        lo, hi = table.init_bounds()
        native = cpu_id_map.ResetTable.of(weight, zeroed, lo, hi) if way == "native" else None
        route = ResetRoute(way, zeroed, lo, hi, native)
        return ResetTarget(table, optimizer_name, weight, states, route)


@dataclass(frozen=True, slots=True)
class FreshTable:
    """One table's fresh rows to reset (`reset_fresh_tables`): its `ResetTarget` (kept by its
    collection, route included) and the remap's result."""

    target: ResetTarget
    fresh: Remapped


def reset_fresh_tables(maps: IdMaps, tables: Sequence[FreshTable]) -> None:
    """Re-initialise every table's fresh rows (`init_rows`) and zero their per-row optimizer
    state (`reset_state_rows`). The observers are told of every table first; then the
    uniform-initialised float32 CPU tables are reset in one native call (the tables over
    torch's threads), the others one by one."""
    ResetPlan(tables).run(maps)


class ResetPlan:
    """`reset_fresh_tables` of ``tables``, worked out now and run later (`run`): a pipeline's
    worker makes the plan (which table goes which way, the native call's arguments), so the
    forward that takes the step only writes. ``targets``: what the tables' weights and states
    were taken from, for the forward to check the plan still holds (None: not said)."""

    def __init__(self, tables: Sequence[FreshTable], targets: object = None) -> None:
        self.targets = targets
        self.tables = [t for t in tables if t.fresh.num_fresh()]
        native: dict[str, tuple[ResetTarget, cpu_id_map.RowsAt]] = {}
        keep: list[object] = []  # what the native call's addresses point into
        self._hashed: list[FreshTable] = []
        self._others: list[FreshTable] = []
        for t in self.tables:
            route = t.target.route
            if route.way == "device":
                self._hashed.append(t)
            elif route.way == "native":
                native[t.target.table.name] = t.target, _rows_at(t, keep)
            else:
                self._others.append(t)
        self._native = _prepare_native(native, targets, keep)

    def run(self, maps: IdMaps) -> None:
        """Tell the observers of every table, then reset the rows."""
        for t in self.tables if maps.observers else ():
            table, _, weight, states, _ = t.target
            maps.before_reset(table.name, weight, states, t.fresh.fresh_rows)
        for t in self._others:
            table, optimizer_name, weight, states, _ = t.target
            init_rows(table, weight, t.fresh, t.fresh.stats.step)
            reset_state_rows(optimizer_name, states, t.fresh.fresh_rows)
        self._native(torch.get_num_threads())
        _reset_hashed(self._hashed)


class ResetTargets(dict[str, ResetTarget]):
    """Per table name: its `ResetTarget` (a collection's, made once with its kernels' views);
    and the native reset's fixed part for all of them that reset natively (`native`), made at
    first use, so a step's `ResetPlan` adds only the rows (tables without fresh rows in that
    step pass none)."""

    _native: tuple[list[str], cpu_id_map.ResetTables] | None = None

    def __setitem__(self, name: str, target: ResetTarget) -> None:
        self._native = None
        super().__setitem__(name, target)

    def __getstate__(self) -> dict[str, object]:
        """A copy or pickle makes its fixed part again (C arrays of this one's addresses)."""
        return {k: v for k, v in self.__dict__.items() if k != "_native"}

    def native(self) -> tuple[list[str], cpu_id_map.ResetTables]:
        """The names of the tables reset natively, and their `cpu_id_map.ResetTables`."""
        if self._native is None:
            native = {n: t.route.native for n, t in self.items() if t.route.native is not None}
            self._native = list(native), cpu_id_map.ResetTables.of(list(native.values()))
        return self._native


_NO_ROWS = cpu_id_map.RowsAt(0, 0, 0, 0, None)  # a table without fresh rows in this step


def fresh_resets(
    targets: Mapping[str, ResetTarget], results: Mapping[str, Remapped]
) -> list[FreshTable]:
    """A `FreshTable` per result with fresh rows, its table's target from ``targets``."""
    return [
        FreshTable(targets[name], fresh) for name, fresh in results.items() if fresh.num_fresh()
    ]


def _prepare_native(
    native: Mapping[str, tuple[ResetTarget, cpu_id_map.RowsAt]], targets: object, keep: object
) -> Callable[[int], None]:
    """The native reset of ``native``'s rows (per table: its target and rows), with the fixed
    part ``targets`` keeps (`ResetTargets.native`) where the targets are those."""
    if isinstance(targets, ResetTargets) and native:
        names, fixed = targets.native()
        if all(targets.get(name) is target for name, (target, _) in native.items()):
            at = [native[name][1] if name in native else _NO_ROWS for name in names]
            return cpu_id_map.prepare_reset_at(fixed, at, keep)
    tables = [target.route.native for target, _ in native.values()]
    at = [rows for _, rows in native.values()]
    return cpu_id_map.prepare_reset_at([t for t in tables if t is not None], at, keep)


def _rows_at(t: FreshTable, keep: list[object]) -> cpu_id_map.RowsAt:
    """Where a table's fresh rows, ids and made values are, for the native reset: in their
    step's `FreshBlock` (no tensors made), else in the result's tensors; what the addresses
    point into is added to ``keep``."""
    f, dim = t.fresh, t.target.weight.shape[1]
    if f.block is not None:
        block, i = f.block
        keep.append(block)
        rows_at, ids_at = block.rows_at(i)
        values_at = block.values_at(i, dim)
        return cpu_id_map.RowsAt(rows_at, ids_at, block.counts[i], f.stats.step, values_at)
    rows, ids = cpu_id_map.int64_contiguous(f.fresh_rows), cpu_id_map.int64_contiguous(f.fresh_ids)
    values = _made_values(t)
    keep.append((rows, ids, values))
    return cpu_id_map.RowsAt(
        rows.data_ptr(), ids.data_ptr(), rows.numel(), f.stats.step,
        None if values is None else values.data_ptr(),
    )  # fmt: skip


def _made_values(t: FreshTable) -> torch.Tensor | None:
    """The fresh rows' initial weights made ahead (``Remapped.fresh_values``), or None when
    none were made or they are not this table's rows (then they are hashed at the reset)."""
    values = t.fresh.fresh_values
    if values is None or values.shape != (t.fresh.fresh_rows.numel(), t.target.weight.shape[1]):
        return None
    return values


def _reset_hashed(tables: Sequence[FreshTable]) -> None:
    """`init_rows` and `reset_state_rows` of uniform-initialised tables on a device (CUDA),
    their initial values hashed for all tables of one width at once (a table's own hash is
    ~15 kernel launches, each a few microseconds of host time), and all rows written through
    `write_rows` (one index per storage: fbgemm keeps a kernel's tables in one)."""
    if not tables:  # (CPU tables: every forward of an id-mapped collection comes here)
        return
    writes: list[RowWrite] = []
    groups: dict[tuple[torch.device, int], list[FreshTable]] = {}
    for t in tables:
        values = _made_values(t)  # made on a pipeline's worker and copied over
        weight = t.target.weight
        if values is not None:
            writes.append((weight, t.fresh.fresh_rows, values))
        else:
            groups.setdefault((weight.device, weight.shape[1]), []).append(t)
    with torch.no_grad():
        for (device, dim), group in groups.items():
            ids = torch.cat([t.fresh.fresh_ids for t in group])
            sizes = [t.fresh.fresh_ids.numel() for t in group]
            # made on the host and copied without waiting (a plain copy would wait for the GPU)
            counts = to_device(torch.tensor(sizes), device)
            per_table = to_device(  # each table's step (exact below 2^53) and init bounds
                torch.tensor(
                    [(t.fresh.stats.step, t.target.route.lo, t.target.route.hi) for t in group],
                    dtype=torch.float64,
                ),
                device,
            ).repeat_interleave(counts, dim=0, output_size=ids.numel())
            steps, lo_hi = per_table[:, 0].to(torch.int64), per_table[:, 1:]
            unit = hash_uniform_torch(ids, steps, dim)
            values = lo_hi[:, :1] + (lo_hi[:, 1:] - lo_hi[:, :1]) * unit
            for t, part in zip(group, values.split(sizes), strict=True):
                writes.append((t.target.weight, t.fresh.fresh_rows, part))
        for t in tables:  # the per-row states, as the route found them
            for state in t.target.route.zeroed:
                writes.append((state, t.fresh.fresh_rows, None))
        write_rows(writes)


RowWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def write_rows(writes: Sequence[RowWrite]) -> None:
    """``view[rows] = values`` for each ``(view, rows, values)`` (zeros where values is None).

    Views that are whole rows of one storage (a kernel's tables laid out in one flat tensor,
    as fbgemm keeps them; same dtype and row shape) are written with one index over that
    storage: a handful of kernel launches for all of them instead of one or two a table.
    """
    groups: dict[tuple[int, torch.dtype, tuple[int, ...], bool], list[RowWrite]] = {}
    for view, rows, values in writes:
        if rows.numel():
            storage = view.untyped_storage().data_ptr()
            key = (storage, view.dtype, tuple(view.shape[1:]), values is None)
            groups.setdefault(key, []).append((view, rows, values))
    with torch.no_grad():
        for group in groups.values():
            row = math.prod(group[0][0].shape[1:])
            whole = all(v.is_contiguous() and v.storage_offset() % row == 0 for v, _, _ in group)
            if len(group) == 1 or not whole:
                for view, rows, values in group:
                    view[rows] = 0 if values is None else values.to(view.device, view.dtype)
                continue
            _write_one_storage(group, row)


def _write_one_storage(group: Sequence[RowWrite], row: int) -> None:
    """`write_rows` of views that are whole rows (``row`` elements each) of one storage."""
    first = group[0][0]
    device = first.device
    total = first.untyped_storage().nbytes() // first.element_size() // row
    every = first.as_strided((total, *first.shape[1:]), first.stride(), 0)
    sizes = [rows.numel() for _, rows, _ in group]
    starts = torch.tensor([view.storage_offset() // row for view, _, _ in group])
    index = torch.cat([rows for _, rows, _ in group]) + to_device(starts, device).repeat_interleave(
        to_device(torch.tensor(sizes), device), output_size=sum(sizes)
    )
    if group[0][2] is None:
        every[index] = 0
    else:
        values = torch.cat([v.to(device) for _, _, v in group if v is not None])
        every[index] = values.to(first.dtype)


_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_ROUTE_SALT = 0x5851F42D4C957F2D


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def fresh_values(
    results: Mapping[str, Remapped], tables: Mapping[str, BaseEmbeddingConfig], threads: int
) -> None:
    """Make the initial weights of every result's fresh rows now (``Remapped.fresh_values``,
    what `reset_fresh_tables` then copies instead of hashing): for the tables of ``tables``
    (uniform init, float32 weights) on CPU, in one native call over ``threads``."""
    made = [
        (result, tables[name])
        for name, result in results.items()
        if name in tables
        and result.num_fresh()
        and (result.block is not None or result.fresh_ids.device.type == "cpu")
    ]
    if not made or not cpu_id_map.available():
        return
    first = made[0][0].block
    if first is not None and all(r.block and r.block[0] is first[0] for r, _ in made):
        _fill_block(made, threads)  # one native step's: by addresses, into one buffer
        return
    values = cpu_id_map.fill_values(
        [result.fresh_ids for result, _ in made],
        [result.stats.step for result, _ in made],
        [table.embedding_dim for _, table in made],
        [table.init_bounds() for _, table in made],
        threads,
    )
    for (result, _), value in zip(made, values, strict=True):
        result.fresh_values = value


def _fill_block(made: Sequence[tuple[Remapped, BaseEmbeddingConfig]], threads: int) -> None:
    """`fresh_values` of results of one `FreshBlock`: their values in one buffer there."""
    first = made[0][0].block
    assert first is not None
    block = first[0]
    indices = [result.block[1] for result, _ in made if result.block is not None]
    dims = [table.embedding_dim for _, table in made]
    values, starts = cpu_id_map.fill_values_at(
        [block.rows_at(i)[1] for i in indices],
        [block.counts[i] for i in indices],
        [result.stats.step for result, _ in made],
        dims,
        [table.init_bounds() for _, table in made],
        threads,
    )
    block.value_starts, block.dims = [-1] * len(block.counts), [0] * len(block.counts)
    for i, start, dim in zip(indices, starts, dims, strict=True):
        block.value_starts[i], block.dims[i] = start, dim
    block.values = values


def route_shard(ids_M: torch.Tensor, num_shards: int | torch.Tensor) -> torch.Tensor:
    """The row shard (``0 .. num_shards - 1``) that owns each raw id of an id-mapped table.

    A fixed function of the raw id alone (splitmix64 of the id, unrelated to `hash_uniform`'s
    draws), the same on every device, rank and version: a sharded table's ids go to the shard
    that keeps their map, and a checkpoint loaded under another plan re-routes them by it.
    ``num_shards`` may be a tensor of one count per id (the ids of several tables at once).
    """
    if isinstance(num_shards, int) and num_shards == 1:
        return torch.zeros_like(ids_M, dtype=torch.int64)
    key = _shift_right(_mix(ids_M.to(torch.int64) + _ROUTE_SALT), 1)  # 63 bits: >= 0
    return key % num_shards


def hash_uniform(ids_K: torch.Tensor, step: int, dim: int) -> torch.Tensor:
    """``[K, dim]`` float64 values in [0, 1), a fixed function of (id, step, column)."""
    if ids_K.device.type == "cpu" and cpu_id_map.available():
        return cpu_id_map.hash_uniform(ids_K, step, dim)  # the same bits, without temporaries
    return hash_uniform_torch(ids_K, step, dim)


def hash_uniform_torch(ids_K: torch.Tensor, step: int | torch.Tensor, dim: int) -> torch.Tensor:
    """`hash_uniform` in torch ops (any device; the reference of the native one); ``step``
    may be a tensor of one step per id."""
    column = torch.arange(dim, dtype=torch.int64, device=ids_K.device)
    key = _mix(ids_K.to(torch.int64) * _GOLDEN + step)
    x = _mix(key.unsqueeze(1) + (column.unsqueeze(0) + 1) * _GOLDEN)
    return _shift_right(x, 11).to(torch.float64) / float(1 << 53)
