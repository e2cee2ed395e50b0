"""Planner output: per-rank memory and estimated step time, and each table's choice, printable.

The figures are the planner's own estimates (docs/planner.md), not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from recopt.sharding.planner.partitioner import Placement
from recopt.sharding.planner.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class TableChoice:
    """What the planner chose for one table."""

    module: str
    table: str
    sharding: str
    optimizer: str
    ranks: tuple[int, ...]
    bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanStats:
    """Estimates for a plan.

    Attributes:
        rank_bytes: estimated peak bytes per rank.
        rank_seconds: estimated seconds per step per rank.
        usable_bytes: memory per rank the planner may fill.
        memory_bytes: memory per rank before the reserve.
        tables: one entry per table.
    """

    rank_bytes: tuple[int, ...]
    rank_seconds: tuple[float, ...]
    usable_bytes: int
    memory_bytes: int
    tables: tuple[TableChoice, ...]

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
        lines = [
            f"ranks: {len(self.rank_bytes)}; usable memory per rank "
            f"{format_bytes(self.usable_bytes)} of {format_bytes(self.memory_bytes)}; "
            f"estimated step {self.max_seconds * 1e3:.3f} ms "
            f"(lower bound {self.lower_bound_seconds * 1e3:.3f} ms)",
            f"{'rank':>5} {'memory':>11} {'used':>6} {'est. ms':>10}",
        ]
        for r, (b, s) in enumerate(zip(self.rank_bytes, self.rank_seconds, strict=True)):
            used = b / self.usable_bytes if self.usable_bytes else 0.0
            lines.append(f"{r:>5} {format_bytes(b):>11} {used:>6.1%} {s * 1e3:>10.3f}")
        ordered = sorted(self.tables, key=lambda t: (-t.bytes, t.module, t.table))
        width = max([len(t.table) for t in ordered] + [5])
        lines.append(
            f"{'table':<{width}} {'module':<16} {'sharding':<24} {'optimizer':<17} "
            f"{'ranks':<12} {'memory':>11} {'est. ms':>9}"
        )
        for t in ordered[:max_tables]:
            lines.append(
                f"{t.table:<{width}} {t.module or '(root)':<16} {t.sharding:<24} "
                f"{t.optimizer:<17} {format_ranks(t.ranks):<12} {format_bytes(t.bytes):>11} "
                f"{t.seconds * 1e3:>9.3f}"
            )
        if len(ordered) > max_tables:
            lines.append(f"... and {len(ordered) - max_tables} smaller tables")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def make_stats(placement: Placement, topology: Topology) -> PlanStats:
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
            )
        )
    return PlanStats(
        rank_bytes=tuple(placement.rank_bytes),
        rank_seconds=tuple(placement.rank_cost),
        usable_bytes=topology.usable_bytes,
        memory_bytes=topology.memory_bytes,
        tables=tuple(tables),
    )


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
