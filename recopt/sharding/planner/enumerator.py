"""Enumerator: every valid way to shard each table (sharding type x kernel x layout x placement).

Each `ShardingOption` carries its shard shapes and, per shard, the storage and cost estimates;
ranks are chosen later by the partitioner (row-wise and data-parallel layouts come with theirs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.fbgemm_backend import (
    FBGEMM_DIM_MULTIPLE,
    fbgemm_auto_objections,
    fbgemm_precision_problems,
    fbgemm_weight_decay_problem,
)
from recopt.kernels.placement import DEVICE, Location, Placement
from recopt.kernels.precision import Precision
from recopt.kernels.registry import fbgemm_spec_names
from recopt.modules.config import EmbeddingConfig
from recopt.sharding.layout import needs_row_stat_hook, sharding_refusal
from recopt.sharding.plan import ParameterSharding, PlanError, ShardingType
from recopt.sharding.plan_validation import id_map_refusal, id_map_types
from recopt.sharding.planner.constraints import (
    ParameterConstraints,
    TableWorkload,
    module_label,
)
from recopt.sharding.planner.perf import replica_cost, shard_cost
from recopt.sharding.planner.storage import (
    replica_storage_bytes,
    resident_bytes,
    shard_storage_bytes,
)
from recopt.sharding.planner.topology import Topology
from recopt.sharding.sharding_types import sharding_spec

# Preference among options of equal estimated cost: fewer shards and less communication first.
TYPE_ORDER = {t: i for i, t in enumerate(ShardingType)}


class EnumerationError(ValueError):
    """No option satisfies a table's constraints; the message names the table and why."""


@dataclass(slots=True)
class ShardingOption:
    """One way to shard one table, with per-shard estimates.

    Attributes:
        module: the module path.
        table: the table config.
        sharding_type: the strategy.
        backend: the kernel backend.
        optimizer: the fused optimizer the estimates assume.
        shard_sizes: (rows, cols) per shard, in order along the split axis; data-parallel: one
            entry for the replica every rank holds.
        shard_bytes: storage estimate per shard (data-parallel: per rank).
        shard_costs: seconds per step per shard (data-parallel: per rank).
        fixed_ranks: the rank of each shard when the layout fixes it (row-wise over all ranks;
            data-parallel: every rank); ``None`` when the partitioner chooses.
        plan_optimizer: the optimizer written into the plan: a constraint's, else ``None``
            (the module keeps its own).
        placement: where the shards' rows live (device memory, UVM, UVM with a cache).
        shard_host_bytes: host memory per shard for UVM placements (data-parallel: per rank);
            empty means none.
        slowdown: seconds per step this option costs over the same layout in device memory
            (0 for ``device``).
    """

    module: str
    table: Any
    sharding_type: ShardingType
    backend: Backend
    optimizer: FusedOptimizerConfig
    shard_sizes: list[tuple[int, int]]
    shard_bytes: list[int]
    shard_costs: list[float]
    fixed_ranks: list[int] | None
    plan_optimizer: FusedOptimizerConfig | None = None
    placement: Placement = DEVICE
    shard_host_bytes: list[int] = field(default_factory=list)
    slowdown: float = 0.0
    total_cost: float = field(init=False)
    max_shard_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        replicas = len(self.fixed_ranks or ()) if self.is_replicated else 1
        self.total_cost = sum(self.shard_costs) * replicas
        self.max_shard_bytes = max(self.shard_bytes)
        if not self.shard_host_bytes:
            self.shard_host_bytes = [0] * len(self.shard_bytes)

    @property
    def is_replicated(self) -> bool:
        """Data-parallel: every rank holds the whole table."""
        return self.sharding_type.replicated

    @property
    def host_local(self) -> bool:
        """All shards must land on the ranks of one host."""
        return self.sharding_type.host_local

    def describe(self) -> str:
        """A short label, e.g. ``row_wise x8`` or ``column_wise x4``."""
        n = len(self.shard_sizes)
        label = self.sharding_type.value if n == 1 else f"{self.sharding_type.value} x{n}"
        if self.backend is not Backend.AUTO:
            label += f" ({self.backend.value})"
        return label

    def to_parameter_sharding(
        self, shard_ranks: Sequence[int], world_size: int
    ) -> ParameterSharding:
        """The plan entry once the partitioner has put shard i on ``shard_ranks[i]``."""
        if self.is_replicated:
            return ParameterSharding(
                sharding_type=self.sharding_type,
                ranks=tuple(range(world_size)),
                backend=self.backend,
                optimizer=self.plan_optimizer,
                placement=self.placement,
            )
        shards = sharding_spec(self.sharding_type).place(self.shard_sizes, shard_ranks)
        return ParameterSharding(
            sharding_type=self.sharding_type,
            ranks=tuple(sorted(set(shard_ranks))),
            shards=tuple(shards),
            backend=self.backend,
            optimizer=self.plan_optimizer,
            placement=self.placement,
        )


def table_workload(
    table: Any, constraints: ParameterConstraints, batch_size: int, optimizer: FusedOptimizerConfig
) -> TableWorkload:
    """The workload the estimators assume for ``table`` (``optimizer``: the module's for it).

    An unpooled table (`EmbeddingConfig`, an embedding collection's) is looked up as bags of
    one id each (recopt/modules/unpooled.py): ``pooling_factor`` times more bags of one id.
    """
    bags = constraints.batch_size or batch_size
    pooling_factor = constraints.pooling_factor
    if isinstance(table, EmbeddingConfig):
        bags, pooling_factor = math.ceil(bags * pooling_factor), 1.0
    return TableWorkload(
        batch_size=bags,
        num_features=max(1, len(getattr(table, "feature_names", ()) or ())),
        pooling_factor=pooling_factor,
        optimizer=constraints.optimizer or optimizer,
        weight_dtype=getattr(table, "weight_dtype", Precision.FP32),
        cache_hit_rate=constraints.cache_hit_rate,
    )


def enumerate_options(
    module: str,
    table: Any,
    constraints: ParameterConstraints,
    workload: TableWorkload,
    topology: Topology,
) -> list[ShardingOption]:
    """Every option for one table, cheapest total cost first.

    Raises:
        EnumerationError: the constraints leave no option (naming the table and the reason).
    """
    where = f"table {table.name!r} (module {module_label(module)})"
    kinds = _allowed_types(constraints, workload.optimizer, topology, where)
    if getattr(table, "id_map", None) is not None:
        kinds = _id_map_types(kinds, constraints, workload.optimizer, where)
    kernels = constraints.backends or (workload.optimizer.backend,)
    placements = _allowed_placements(constraints, topology, where)
    layouts = [(k, layout) for k in kinds for layout in _layouts(k, table, constraints, topology)]
    # Every type has a layout (column-wise falls back to one shard when named explicitly).
    assert layouts, where
    options: list[ShardingOption] = []
    rejected: list[str] = []
    cache: dict[tuple[Any, ...], tuple[int, int, float]] = {}
    for kind, (sizes, fixed) in layouts:
        for kernel in kernels:
            for placement in placements:
                why = _kernel_problem(kernel, kind, sizes, workload, topology.device, placement)
                if why:
                    rejected.append(why)
                    continue
                choice = (kind, kernel, placement)
                options.append(
                    _option(module, table, choice, sizes, fixed, workload, topology, cache)
                )
    if not options:
        raise EnumerationError(f"{where}: no allowed kernel can run it: {'; '.join(rejected[:3])}")
    for o in options:
        o.plan_optimizer = constraints.optimizer
    kernel_rank = {k: i for i, k in enumerate(kernels)}
    placement_rank = {p: i for i, p in enumerate(placements)}
    options.sort(
        key=lambda o: (
            o.total_cost,
            o.max_shard_bytes,
            TYPE_ORDER[o.sharding_type],
            len(o.shard_sizes),
            kernel_rank[o.backend],
            placement_rank[o.placement],
        )
    )
    return options


def _allowed_placements(
    c: ParameterConstraints, topology: Topology, where: str
) -> tuple[Placement, ...]:
    """The constraint's placements, else device, UVM caching and UVM on cuda (device on cpu)."""
    if topology.device != "cuda":
        off_device = [p.describe() for p in c.placements or () if not p.on_device]
        if off_device:
            raise EnumerationError(
                f"{where}: placements {off_device} need CUDA (UVM is CUDA memory), but the "
                "topology's device is 'cpu'; use placement 'device' or a cuda topology"
            )
        return (DEVICE,)
    if c.placements is not None:
        return c.placements
    cached = Placement(location=Location.UVM_CACHING, cache_load_factor=topology.cache_load_factor)
    return (DEVICE, cached, Placement(location=Location.UVM))


def _allowed_types(
    c: ParameterConstraints, optimizer: FusedOptimizerConfig, topology: Topology, where: str
) -> tuple[ShardingType, ...]:
    kinds = c.sharding_types or _default_types(topology)
    # Statistics over the whole table (adafactor) or norms over full rows (lamb): the types
    # the sharded module would reject are left out (sharding/layout.py, `sharding_refusal`).
    allowed = tuple(k for k in kinds if not sharding_refusal(k, optimizer.name))
    if not allowed:
        ok = [k for k in ShardingType if not sharding_refusal(k, optimizer.name)]
        supported = [k.value for k in sorted(ok, key=lambda k: k.replicated)]  # replicas last
        names = " and ".join(
            [", ".join(supported[:-1]), supported[-1]] if supported[1:] else supported
        )
        raise EnumerationError(
            f"{where}: the fused optimizer {optimizer.name} supports {names} sharding only, "
            "and the constraints allow "
            f"{[k.value for k in kinds]}; allow one of those or pick another optimizer"
        )
    return allowed


def _id_map_types(
    kinds: tuple[ShardingType, ...],
    c: ParameterConstraints,
    optimizer: FusedOptimizerConfig,
    where: str,
) -> tuple[ShardingType, ...]:
    """``kinds`` less the types an id-mapped table cannot have (`id_map_refusal`: column
    shards and replicas); none left is an error naming the types it may have."""
    allowed = tuple(k for k in kinds if not id_map_refusal(k))
    if allowed:
        return allowed
    ok = [k.value for k in id_map_types() if not sharding_refusal(k, optimizer.name)]
    asked = [k.value for k in c.sharding_types or kinds]
    raise EnumerationError(
        f"{where}: an id-mapped table needs one owner per row (column shards or replicas "
        f"would each need the whole map), so it can be sharded {ok} only (with "
        f"{optimizer.name}), but the constraints allow {asked}; allow one of {ok} or drop "
        "its id_map"
    )


def _default_types(topology: Topology) -> tuple[ShardingType, ...]:
    if topology.num_hosts > 1:
        return tuple(ShardingType)
    # On one host the table-* types are the same layouts as row-wise / column-wise.
    return tuple(t for t in ShardingType if not t.host_local)


def _layouts(
    kind: ShardingType, table: Any, c: ParameterConstraints, topology: Topology
) -> list[tuple[list[tuple[int, int]], list[int] | None]]:
    rows, dim, w = table.num_embeddings, table.embedding_dim, topology.world_size
    spec, where = sharding_spec(kind), f"table {table.name!r}"
    if spec.replicated:
        return [(spec.cut(rows, dim, 1, where), list(range(w)))]
    if spec.one_shard:
        return [(spec.cut(rows, dim, 1, where), None)]
    group = topology.local_world_size if spec.host_local else w
    if spec.splits_rows:
        sizes = spec.cut(rows, dim, group, where)
        # Over every rank, row range i lands on rank i; on one host the partitioner picks it.
        return [(sizes, None if spec.host_local else list(range(len(sizes))))]
    layouts: list[tuple[list[tuple[int, int]], list[int] | None]] = []
    parts = 2
    while parts <= min(group, dim // c.min_partition):
        try:
            sizes = spec.cut(rows, dim, parts, where)
        except PlanError:
            sizes = []
        if sizes and min(cols for _, cols in sizes) >= c.min_partition:
            layouts.append((sizes, None))
        parts *= 2
    if not layouts and c.sharding_types is not None:
        layouts.append(([(rows, dim)], None))  # asked for explicitly: one full-height shard
    return layouts


def _kernel_problem(
    kernel: Backend,
    kind: ShardingType,
    sizes: list[tuple[int, int]],
    workload: TableWorkload,
    device: str,
    placement: Placement = DEVICE,
) -> str:
    optimizer = workload.optimizer
    if not placement.on_device:
        # Only fbgemm's CUDA kernel reads UVM: AUTO must resolve to it, recopt cannot.
        if kernel is Backend.RECOPT or optimizer.backend is Backend.RECOPT:
            return f"placement {placement.describe()!r} needs the fbgemm kernel, not recopt's"
        why = _kernel_problem(Backend.FBGEMM, kind, sizes, workload, device)
        if not why and Backend.FBGEMM not in (kernel, optimizer.backend):
            why = "; ".join(fbgemm_auto_objections(optimizer, torch.device(device)))
        return f"placement {placement.describe()!r} needs the fbgemm kernel: {why}" if why else ""
    if kernel is not Backend.FBGEMM:
        return ""
    spec = TableSpec(
        name="shard", num_embeddings=1, embedding_dim=4, weight_dtype=workload.weight_dtype
    )
    precision = fbgemm_precision_problems([spec], optimizer, torch.device(device))
    if precision:
        return precision[0]
    if needs_row_stat_hook(kind, optimizer):
        # A column shard of a row-wise optimizer needs the statistic of the full row, which
        # only recopt's kernel computes (sharding/layout.py).
        return f"fbgemm cannot run {optimizer.name!r} on column shards (no full-row statistic)"
    runs = fbgemm_spec_names(device)  # its CUDA build runs more than its CPU build
    if optimizer.name not in runs:
        return (
            f"fbgemm does not run optimizer {optimizer.name!r} on {device} (it runs {sorted(runs)})"
        )
    decay = fbgemm_weight_decay_problem(optimizer, device)
    if decay:
        return decay
    odd = [cols for _, cols in sizes if cols % FBGEMM_DIM_MULTIPLE]
    if odd:
        return (
            f"fbgemm needs shard widths that are multiples of {FBGEMM_DIM_MULTIPLE}, not {odd[0]}"
        )
    return ""


def _option(
    module: str,
    table: Any,
    choice: tuple[ShardingType, Backend, Placement],
    sizes: list[tuple[int, int]],
    fixed: list[int] | None,
    workload: TableWorkload,
    topology: Topology,
    cache: dict[tuple[Any, ...], tuple[int, int, float]],
) -> ShardingOption:
    kind, kernel, placement = choice
    k = len(sizes) if kind.splits_columns else 1
    places = {placement, DEVICE}  # the device estimate gives the placement's slowdown
    for n, d in set(sizes):  # row-wise layouts repeat two shapes: estimate each once
        for p in places:
            key = (kind, k, n, d, p)
            if key not in cache:
                cache[key] = shard_estimate(kind, k, n, d, table, workload, topology, p)
    estimates = [cache[(kind, k, n, d, placement)] for n, d in sizes]
    device_seconds = sum(cache[(kind, k, n, d, DEVICE)][2] for n, d in sizes)
    option = ShardingOption(
        module=module,
        table=table,
        sharding_type=kind,
        backend=kernel,
        optimizer=workload.optimizer,
        shard_sizes=sizes,
        shard_bytes=[b for b, _, _ in estimates],
        shard_costs=[t for _, _, t in estimates],
        fixed_ranks=fixed,
        placement=placement,
        shard_host_bytes=[h for _, h, _ in estimates],
    )
    replicas = topology.world_size if option.is_replicated else 1
    option.slowdown = max(0.0, option.total_cost - device_seconds * replicas)
    return option


def shard_estimate(
    kind: ShardingType,
    k: int,
    n: int,
    d: int,
    table: Any,
    workload: TableWorkload,
    topology: Topology,
    placement: Placement,
) -> tuple[int, int, float]:
    """(device bytes, host bytes, seconds) of one ``n x d`` shard (a whole replica for
    data-parallel) of ``table`` under one placement; ``k`` column shards share its rows."""
    rows, w = table.num_embeddings, topology.world_size
    _, host = resident_bytes(n, d, workload, placement)
    if kind.replicated:
        return (
            replica_storage_bytes(n, d, workload, w, placement),
            host,
            replica_cost(n, d, workload, topology, placement).total,
        )
    return (
        shard_storage_bytes(kind, n, d, rows, workload, w, placement),
        host,
        shard_cost(kind, n, d, rows, workload, topology, k, placement).total,
    )


def enumerate_all(
    tables_by_module: Mapping[str, Sequence[Any]],
    constraints: Mapping[tuple[str, str], ParameterConstraints],
    batch_size: int,
    optimizers: Callable[[str, str], FusedOptimizerConfig],
    topology: Topology,
) -> list[list[ShardingOption]]:
    """Options for every table, in module order then table order.

    ``optimizers(module, table)`` is the optimizer the module runs the table with; a
    constraint's optimizer overrides it and is then written into the plan.

    Raises:
        EnumerationError: some table has no option.
    """
    default = ParameterConstraints()
    result = []
    for module, tables in tables_by_module.items():
        for t in tables:
            c = constraints.get((module, t.name), default)
            workload = table_workload(t, c, batch_size, optimizers(module, t.name))
            result.append(enumerate_options(module, t, c, workload, topology))
    return result
