"""Planner output: per-rank memory and estimated step time, and each table's choice, printable.

The figures are the planner's own estimates (docs/planner.md), not measurements.
`evaluate_plan` computes the same figures for any plan, e.g. one written by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.placement import DEVICE
from recopt.sharding.plan import ParameterSharding, ShardingPlan
from recopt.sharding.planner.constraints import (
    ParameterConstraints,
    TableWorkload,
    resolve_constraints,
)
from recopt.sharding.planner.enumerator import shard_estimate, table_workload
from recopt.sharding.planner.partitioner import RankAssignment
from recopt.sharding.planner.storage import (
    rank_output_bytes,
)
from recopt.sharding.planner.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class TableChoice:
    """What the planner chose for one table (``bytes`` in device memory, ``host_bytes`` in host
    memory for UVM; ``slowdown_seconds``: its cost over the same layout in device memory)."""

    module: str
    table: str
    sharding: str
    optimizer: str
    ranks: tuple[int, ...]
    bytes: int
    seconds: float
    placement: str = "device"
    host_bytes: int = 0
    slowdown_seconds: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanStats:
    """Estimates for a plan.

    Attributes:
        rank_bytes: estimated peak bytes per rank.
        rank_seconds: estimated seconds per step per rank.
        usable_bytes: memory per rank the planner may fill.
        memory_bytes: memory per rank before the reserve.
        tables: one entry per table.
        rank_host_bytes: estimated host memory per rank taken by UVM placements.
        host_usable_bytes: host memory per rank UVM may fill (0 on a cpu topology).
    """

    rank_bytes: tuple[int, ...]
    rank_seconds: tuple[float, ...]
    usable_bytes: int
    memory_bytes: int
    tables: tuple[TableChoice, ...]
    rank_host_bytes: tuple[int, ...] = ()
    host_usable_bytes: int = 0

    @property
    def off_device(self) -> tuple[TableChoice, ...]:
        """The tables placed in UVM (with or without a cache)."""
        return tuple(t for t in self.tables if t.placement != "device")

    @property
    def max_seconds(self) -> float:
        """The slowest rank's estimate: the step time."""
        return max(self.rank_seconds)

    @property
    def lower_bound_seconds(self) -> float:
        """Total work over ranks: no assignment of these shards has a lower step time."""
        return sum(self.rank_seconds) / len(self.rank_seconds)

    def format(self, max_tables: int = 50) -> str:
        """A text table: ranks first, then up to ``max_tables`` tables (largest first)."""
        host = self.host_usable_bytes > 0  # a cuda topology: show host memory for UVM too
        lines = [
            f"ranks: {len(self.rank_bytes)}; usable memory per rank "
            f"{format_bytes(self.usable_bytes)} of {format_bytes(self.memory_bytes)}"
            + (f" (+ {format_bytes(self.host_usable_bytes)} host for UVM)" if host else "")
            + f"; estimated step {self.max_seconds * 1e3:.3f} ms "
            f"(lower bound {self.lower_bound_seconds * 1e3:.3f} ms)",
            f"{'rank':>5} {'memory':>11} {'of usable':>11} {'used':>6} {'est. ms':>10}"
            + (f" {'host (UVM)':>11} {'used':>6}" if host else ""),
        ]
        usable = format_bytes(self.usable_bytes)  # the assumed memory the percentage is of
        hosts = self.rank_host_bytes or (0,) * len(self.rank_bytes)
        for r, (b, s) in enumerate(zip(self.rank_bytes, self.rank_seconds, strict=True)):
            used = b / self.usable_bytes if self.usable_bytes else 0.0
            line = f"{r:>5} {format_bytes(b):>11} {usable:>11} {used:>6.1%} {s * 1e3:>10.3f}"
            if host:
                line += f" {format_bytes(hosts[r]):>11} {hosts[r] / self.host_usable_bytes:>6.1%}"
            lines.append(line)
        ordered = sorted(self.tables, key=lambda t: (-t.bytes - t.host_bytes, t.module, t.table))
        width = max([len(t.table) for t in ordered] + [5])
        lines.append(
            f"{'table':<{width}} {'module':<16} {'sharding':<24} {'placement':<17} "
            f"{'optimizer':<17} {'ranks':<12} {'memory':>11} {'host':>11} {'est. ms':>9}"
        )
        for t in ordered[:max_tables]:
            lines.append(
                f"{t.table:<{width}} {t.module or '(root)':<16} {t.sharding:<24} "
                f"{t.placement:<17} {t.optimizer:<17} {format_ranks(t.ranks):<12} "
                f"{format_bytes(t.bytes):>11} {format_bytes(t.host_bytes):>11} "
                f"{t.seconds * 1e3:>9.3f}"
            )
        if len(ordered) > max_tables:
            lines.append(f"... and {len(ordered) - max_tables} smaller tables")
        return "\n".join(lines)

    def explain_placements(self) -> str:
        """Why tables are in UVM, and what it costs; empty when every table is in device memory."""
        moved = self.off_device
        if not moved:
            return ""
        slowdown = sum(t.slowdown_seconds for t in moved)
        names = ", ".join(
            f"{t.table!r} ({t.placement}, +{t.slowdown_seconds * 1e3:.3f} ms)" for t in moved
        )
        return (
            f"{len(moved)} of {len(self.tables)} tables live in host memory (UVM), read by the "
            f"GPU over the host link: {names}. The planner puts a table there only when device "
            f"memory ({format_bytes(self.usable_bytes)} usable per rank) cannot hold it with the "
            "rest, or when a constraint asks for it; it keeps a table in device memory when it "
            "fits, else caches its hot rows in HBM (uvm_caching), else reads it from UVM. "
            f"Estimated slowdown {slowdown * 1e3:.3f} ms of work per step over the same layouts "
            f"in device memory (estimated step {self.max_seconds * 1e3:.3f} ms). More device "
            "memory or ranks, or optimizers with less state, move tables back."
        )

    def __str__(self) -> str:
        return self.format()


def make_stats(placement: RankAssignment, topology: Topology) -> PlanStats:
    """Collect the estimates of a placement."""
    tables = []
    for opt, ranks in zip(placement.options, placement.shard_ranks, strict=True):
        copies = topology.world_size if opt.is_replicated else 1
        tables.append(
            TableChoice(
                module=opt.module,
                table=opt.table.name,
                sharding=opt.describe(),
                optimizer=opt.optimizer.name,
                ranks=tuple(sorted(set(ranks))),
                bytes=sum(opt.shard_bytes) * copies,
                seconds=opt.total_cost,
                placement=opt.placement.describe(),
                host_bytes=sum(opt.shard_host_bytes) * copies,
                slowdown_seconds=opt.slowdown,
            )
        )
    host = placement.rank_host_bytes or [0] * topology.world_size
    return PlanStats(
        rank_bytes=tuple(placement.rank_bytes),
        rank_seconds=tuple(placement.rank_cost),
        usable_bytes=topology.usable_bytes,
        memory_bytes=topology.memory_bytes,
        tables=tuple(tables),
        rank_host_bytes=tuple(host),
        host_usable_bytes=topology.host_usable_bytes,
    )


def evaluate_plan(
    plan: ShardingPlan,
    tables_by_module: Mapping[str, Sequence[Any]],
    topology: Topology,
    batch_size: int = 512,
    default_optimizer: FusedOptimizerConfig | None = None,
    table_optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]] | None = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
) -> PlanStats:
    """The planner's estimates for any plan (hand-written, or from another tool).

    Args:
        plan: a plan valid for ``tables_by_module`` (see `validate_plan`).
        tables_by_module: module path -> its tables.
        topology: bandwidths and memory.
        batch_size: per-rank batch size.
        default_optimizer: as in `EmbeddingShardingPlanner`.
        table_optimizers: as in `EmbeddingShardingPlanner.plan`; a plan entry's own optimizer
            wins over both.
        constraints: for their pooling factors and batch sizes.

    Returns:
        Per-rank bytes and seconds, per-table totals, as `EmbeddingShardingPlanner.stats`.
    """
    w = topology.world_size
    per_table = resolve_constraints(constraints, tables_by_module)
    rank_bytes, rank_host, rank_seconds = [0] * w, [0] * w, [0.0] * w
    choices = []
    for module, tables in tables_by_module.items():
        for t in tables:
            ps = plan[module][t.name]
            optimizer = ps.optimizer or (table_optimizers or {}).get(module, {}).get(
                t.name, default_optimizer or FusedOptimizerConfig()
            )
            c = per_table.get((module, t.name), ParameterConstraints())
            load = table_workload(t, c, batch_size, optimizer)
            for r in range(w):
                rank_bytes[r] += rank_output_bytes(t.embedding_dim, load)
            placed = _placed_estimates(ps, t, load, topology)
            for e in placed:
                rank_bytes[e.rank] += e.nbytes
                rank_host[e.rank] += e.host_bytes
                rank_seconds[e.rank] += e.seconds
            choices.append(_choice(module, t.name, ps, optimizer.name, placed))
    return PlanStats(
        rank_bytes=tuple(rank_bytes),
        rank_seconds=tuple(rank_seconds),
        usable_bytes=topology.usable_bytes,
        memory_bytes=topology.memory_bytes,
        tables=tuple(choices),
        rank_host_bytes=tuple(rank_host),
        host_usable_bytes=topology.host_usable_bytes,
    )


@dataclass(frozen=True, slots=True)
class _ShardEstimate:
    rank: int
    nbytes: int
    host_bytes: int
    seconds: float
    device_seconds: float  # the same shard in device memory


def _choice(
    module: str, table: str, ps: ParameterSharding, optimizer: str, placed: list[_ShardEstimate]
) -> TableChoice:
    label = ps.sharding_type.value + (f" x{len(ps.shards)}" if len(ps.shards) > 1 else "")
    seconds = sum(e.seconds for e in placed)
    return TableChoice(
        module=module,
        table=table,
        sharding=label,
        optimizer=optimizer,
        ranks=ps.ranks,
        bytes=sum(e.nbytes for e in placed),
        seconds=seconds,
        placement=ps.placement.describe(),
        host_bytes=sum(e.host_bytes for e in placed),
        slowdown_seconds=max(0.0, seconds - sum(e.device_seconds for e in placed)),
    )


def _placed_estimates(
    ps: ParameterSharding, table: Any, load: TableWorkload, topology: Topology
) -> list[_ShardEstimate]:
    """The estimates of every shard of one table (every rank for a replica)."""
    kind, where = ps.sharding_type, ps.placement
    k = len(ps.shards) if kind.splits_columns else 1

    def estimate(rank: int, rows: int, cols: int) -> _ShardEstimate:
        nbytes, host, seconds = shard_estimate(kind, k, rows, cols, table, load, topology, where)
        device_seconds = (
            seconds
            if where.on_device
            else shard_estimate(kind, k, rows, cols, table, load, topology, DEVICE)[2]
        )
        return _ShardEstimate(rank, nbytes, host, seconds, device_seconds)

    if kind.replicated:
        replica = estimate(0, table.num_embeddings, table.embedding_dim)
        return [dataclasses.replace(replica, rank=r) for r in ps.ranks]
    return [estimate(s.rank, s.num_rows, s.num_cols) for s in ps.shards]


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_ranks(ranks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``0-2,5``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)
