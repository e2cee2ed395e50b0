"""Partitioner: put every shard of the chosen options on a rank, balancing cost under memory caps.

Longest-processing-time greedy: fixed layouts (data-parallel, row-wise), then host-local groups,
then free shards largest cost first onto the least-loaded rank with room; if memory runs out, a
memory-first pass (largest shard onto the emptiest rank) before reporting what fits nowhere.
Room is device memory and, for shards placed in UVM, host memory too.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from recopt.sharding.planner.enumerator import ShardingOption
from recopt.sharding.planner.topology import Topology


@dataclass(slots=True)
class RankAssignment:
    """A feasible assignment of shards to ranks: the rank of every shard, and the resulting
    load per rank (``rank_bytes`` in device memory, ``rank_host_bytes`` in host memory for UVM).
    Where a shard's rows live on its rank is `recopt.kernels.placement.Placement`."""

    options: list[ShardingOption]
    shard_ranks: list[list[int]]
    rank_bytes: list[int]
    rank_cost: list[float]
    rank_host_bytes: list[int] | None = None

    @property
    def max_cost(self) -> float:
        """The slowest rank's estimated seconds per step (the step time)."""
        return max(self.rank_cost)

    @property
    def bottleneck_rank(self) -> int:
        """The slowest rank (lowest index on ties)."""
        return self.rank_cost.index(self.max_cost)


@dataclass(frozen=True, slots=True)
class AssignmentFailure:
    """A shard that fit on no rank: which, how large, and the best rank's free memory
    (``host``: the memory short was host memory for UVM, not device memory)."""

    option_index: int
    needed_bytes: int
    best_rank: int
    free_bytes: int
    host: bool = False


class _Ranks:
    """Per-rank load and memory during one partitioning pass."""

    def __init__(self, topology: Topology, base_bytes: Sequence[int]) -> None:
        self.cap = topology.usable_bytes
        self.host_cap = topology.host_usable_bytes
        self.bytes = list(base_bytes)
        self.host = [0] * topology.world_size
        self.cost = [0.0] * topology.world_size

    def fits(self, rank: int, nbytes: int, host: int = 0) -> bool:
        if host and self.host[rank] + host > self.host_cap:
            return False
        return self.bytes[rank] + nbytes <= self.cap

    def add(self, rank: int, nbytes: int, cost: float, host: int = 0) -> None:
        self.bytes[rank] += nbytes
        self.host[rank] += host
        self.cost[rank] += cost

    def failure(
        self, index: int, nbytes: int, among: Sequence[int], host: int = 0
    ) -> AssignmentFailure:
        best = min(among, key=lambda r: (self.bytes[r], r))
        if self.bytes[best] + nbytes <= self.cap and host:  # device memory was not short
            best = min(among, key=lambda r: (self.host[r], r))
            free = max(0, self.host_cap - self.host[best])
            return AssignmentFailure(index, host, best, free, host=True)
        return AssignmentFailure(index, nbytes, best, max(0, self.cap - self.bytes[best]))


def partition(
    options: Sequence[ShardingOption], topology: Topology, base_bytes: Sequence[int]
) -> RankAssignment | AssignmentFailure:
    """Assign ranks to the shards of ``options`` (one chosen option per table).

    Args:
        options: the chosen option of every table.
        topology: ranks, hosts and the memory cap (`Topology.usable_bytes`).
        base_bytes: bytes already used on each rank before any shard (pooled-output buffers).

    Returns:
        A `RankAssignment`, or the `AssignmentFailure` of the memory-first pass when neither fits.
    """
    first = _partition(options, topology, base_bytes, memory_first=False)
    if isinstance(first, RankAssignment):
        return first
    return _partition(options, topology, base_bytes, memory_first=True)


def _partition(
    options: Sequence[ShardingOption],
    topology: Topology,
    base_bytes: Sequence[int],
    memory_first: bool,
) -> RankAssignment | AssignmentFailure:
    ranks = _Ranks(topology, base_bytes)
    shard_ranks: list[list[int]] = [[] for _ in options]
    everyone = range(topology.world_size)
    failure = _place_fixed(options, shard_ranks, ranks)
    if failure is not None:
        return failure
    order = sorted(
        (i for i, o in enumerate(options) if o.host_local),
        key=lambda i: (-options[i].total_cost, -options[i].max_shard_bytes, i),
    )
    for i in order:
        chosen = _place_on_a_host(options[i], ranks, topology, memory_first)
        if chosen is None:
            host = max(options[i].shard_host_bytes)
            return ranks.failure(i, options[i].max_shard_bytes, everyone, host)
        shard_ranks[i] = chosen
    failed = _place_free_shards(options, shard_ranks, ranks, memory_first)
    if failed is not None:
        i, j = failed
        opt = options[i]
        return ranks.failure(i, opt.shard_bytes[j], everyone, opt.shard_host_bytes[j])
    return RankAssignment(list(options), shard_ranks, ranks.bytes, ranks.cost, ranks.host)


def _place_fixed(
    options: Sequence[ShardingOption], shard_ranks: list[list[int]], ranks: _Ranks
) -> AssignmentFailure | None:
    """Data-parallel replicas (summed once: they weigh the same on every rank), then row-wise."""
    replicas = [i for i, o in enumerate(options) if o.is_replicated]
    replica_bytes = sum(options[i].shard_bytes[0] for i in replicas)
    replica_host = sum(options[i].shard_host_bytes[0] for i in replicas)
    replica_cost = sum(options[i].shard_costs[0] for i in replicas)
    fullest = max(range(len(ranks.bytes)), key=lambda r: (ranks.bytes[r], -r))
    if not ranks.fits(fullest, replica_bytes, replica_host):
        for i in replicas:  # name the replica that overflows
            nbytes, host = options[i].shard_bytes[0], options[i].shard_host_bytes[0]
            if not ranks.fits(fullest, nbytes, host):
                return ranks.failure(i, nbytes, [fullest], host)
            ranks.add(fullest, nbytes, 0.0, host)
    for r in range(len(ranks.bytes)):
        ranks.add(r, replica_bytes, replica_cost, replica_host)
    everyone = list(range(len(ranks.bytes)))
    for i in replicas:
        shard_ranks[i] = everyone
    for i, opt in enumerate(options):
        if opt.fixed_ranks is None or opt.is_replicated:
            continue
        for j, r in enumerate(opt.fixed_ranks):
            nbytes, host = opt.shard_bytes[j], opt.shard_host_bytes[j]
            if not ranks.fits(r, nbytes, host):
                return ranks.failure(i, nbytes, [r], host)
            ranks.add(r, nbytes, opt.shard_costs[j], host)
        shard_ranks[i] = opt.fixed_ranks
    return None


def _place_free_shards(
    options: Sequence[ShardingOption],
    shard_ranks: list[list[int]],
    ranks: _Ranks,
    memory_first: bool,
) -> tuple[int, int] | None:
    """Place every free shard; returns (option, shard) of the first that fits nowhere."""
    items = [
        (i, j)
        for i, o in enumerate(options)
        if o.fixed_ranks is None and not o.host_local
        for j in range(len(o.shard_sizes))
    ]
    for i, _ in items:
        shard_ranks[i] = [-1] * len(options[i].shard_sizes)
    if memory_first:
        items.sort(key=lambda ij: (-options[ij[0]].shard_bytes[ij[1]], ij))
        heap: list[tuple[float, int]] = [(float(b), r) for r, b in enumerate(ranks.bytes)]
    else:
        items.sort(
            key=lambda ij: (
                -options[ij[0]].shard_costs[ij[1]],
                -options[ij[0]].shard_bytes[ij[1]],
                ij,
            )
        )
        heap = [(c, r) for r, c in enumerate(ranks.cost)]
    heapq.heapify(heap)
    for i, j in items:
        nbytes, cost = options[i].shard_bytes[j], options[i].shard_costs[j]
        host = options[i].shard_host_bytes[j]
        skipped = []
        while heap and not ranks.fits(heap[0][1], nbytes, host):
            skipped.append(heapq.heappop(heap))
            if memory_first and not host:  # the emptiest rank is full: every rank is
                break
        if not heap or not ranks.fits(heap[0][1], nbytes, host):
            return i, j
        _, r = heapq.heappop(heap)
        ranks.add(r, nbytes, cost, host)
        shard_ranks[i][j] = r
        heapq.heappush(heap, (float(ranks.bytes[r]) if memory_first else ranks.cost[r], r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return None


def _place_on_a_host(
    opt: ShardingOption, ranks: _Ranks, topology: Topology, memory_first: bool
) -> list[int] | None:
    """Put a host-local option on the host where it leaves the lowest peak (or most memory)."""
    best: tuple[float, list[int]] | None = None
    for host in range(topology.num_hosts):
        fitted = _fit_on_host(opt, list(topology.host_ranks(host)), ranks, memory_first)
        if fitted is not None and (best is None or fitted[0] < best[0]):
            best = fitted
    if best is None:
        return None
    for j, r in enumerate(best[1]):
        ranks.add(r, opt.shard_bytes[j], opt.shard_costs[j], opt.shard_host_bytes[j])
    return best[1]


def _fit_on_host(
    opt: ShardingOption, host_ranks: list[int], ranks: _Ranks, memory_first: bool
) -> tuple[float, list[int]] | None:
    """(score, rank per shard) of the option on one host, lower score better; None if it fails."""
    distinct = opt.sharding_type.splits_rows  # one row range per rank
    used = {r: float(ranks.bytes[r]) for r in host_ranks}
    host_used = {r: ranks.host[r] for r in host_ranks}
    cost = {r: ranks.cost[r] for r in host_ranks}
    load = used if memory_first else cost
    chosen: list[int] = []
    for nbytes, host, c in zip(opt.shard_bytes, opt.shard_host_bytes, opt.shard_costs, strict=True):
        free = [
            r
            for r in host_ranks
            if used[r] + nbytes <= ranks.cap
            and (not host or host_used[r] + host <= ranks.host_cap)
            and not (distinct and r in chosen)
        ]
        if not free:
            return None
        r = min(free, key=lambda r: (load[r], r))
        chosen.append(r)
        used[r] += nbytes
        host_used[r] += host
        cost[r] += c
    # Memory-first: keep the most free memory on the host's fullest rank; else the lowest peak.
    score = -min(ranks.cap - b for b in used.values()) if memory_first else max(cost.values())
    return score, chosen
