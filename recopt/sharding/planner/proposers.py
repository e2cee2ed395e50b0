"""Proposers: which option each table uses. A greedy first choice, then a local search.

`greedy_proposal`: each table's cheapest option that fits an empty rank; `make_feasible`: spread
tables until the partitioner places everything; `reclaim_device_memory`: move tables the repair
sent to UVM back where they fit; `improve`: try other options for the tables on the slowest
rank, keeping a change only when the step time drops. All deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

from recopt.sharding.planner.enumerator import ShardingOption
from recopt.sharding.planner.partitioner import AssignmentFailure, RankAssignment, partition
from recopt.sharding.planner.topology import Topology

# The search re-partitions once per trial; this many shard placements in total bounds its time
# (about 1 s of Python per 2 million on the development machine) whatever the table count.
SEARCH_PLACEMENT_BUDGET = 4_000_000
# Memory repair spreads at most this share of the tables per round (at least one).
SHRINK_SHARE = 0.05
CANDIDATE_TABLES = 4  # tables on the slowest rank tried per round, largest shard first
ALTERNATIVES_PER_TABLE = 3


def greedy_proposal(options: Sequence[Sequence[ShardingOption]], capacity: int) -> list[int]:
    """Per table, the index of its cheapest option whose largest shard fits ``capacity`` bytes.

    A table with no such option gets its option with the smallest largest shard; the
    partitioner will then report it.
    """
    choice = []
    for opts in options:
        fitting = [k for k, o in enumerate(opts) if o.max_shard_bytes <= capacity]
        if fitting:
            choice.append(fitting[0])
        else:
            choice.append(min(range(len(opts)), key=lambda k: (opts[k].max_shard_bytes, k)))
    return choice


def make_feasible(
    options: Sequence[Sequence[ShardingOption]],
    choice: list[int],
    topology: Topology,
    base_bytes: Sequence[int],
) -> RankAssignment | AssignmentFailure:
    """Spread tables over more ranks until the partitioner places everything, or none can spread.

    Each round moves the tables whose largest shard is at least as large as the one that did
    not fit (largest first, at most `SHRINK_SHARE` of the tables, the failing one included) to
    their cheapest layout with a smaller largest shard: a tight fit takes a few rounds, not one
    per table. Mutates ``choice``. Returns the placement, or the last failure.
    """
    while True:
        chosen = [o[k] for o, k in zip(options, choice, strict=True)]
        result = partition(chosen, topology, base_bytes)
        if isinstance(result, RankAssignment):
            return result
        tables = _tables_to_shrink(options, choice, result)
        if not tables:
            return result
        for t in tables:
            current = options[t][choice[t]].max_shard_bytes
            # Options are sorted by cost: the first smaller one is the cheapest smaller layout.
            choice[t] = next(k for k, o in enumerate(options[t]) if o.max_shard_bytes < current)


def _tables_to_shrink(
    options: Sequence[Sequence[ShardingOption]], choice: list[int], failure: AssignmentFailure
) -> list[int]:
    def current(t: int) -> int:
        return options[t][choice[t]].max_shard_bytes

    shrinkable = [
        t for t in range(len(options)) if any(o.max_shard_bytes < current(t) for o in options[t])
    ]
    if not shrinkable:
        return []
    shrinkable.sort(key=lambda t: (-current(t), t))
    limit = max(1, int(len(options) * SHRINK_SHARE))
    selected = [t for t in shrinkable if current(t) >= failure.needed_bytes][:limit]
    if failure.option_index in shrinkable and failure.option_index not in selected:
        selected.append(failure.option_index)
    # The failing table is as spread as it gets: make room by spreading the largest others.
    return selected or shrinkable[:1]


def reclaim_device_memory(
    options: Sequence[Sequence[ShardingOption]],
    choice: list[int],
    placement: RankAssignment,
    topology: Topology,
    base_bytes: Sequence[int],
) -> RankAssignment:
    """Give tables placed in UVM a cheaper option (device memory, or a cache) where it fits.

    The memory repair moves whole groups of tables at a time and may move more than needed;
    this pass tries, largest slowdown first, each off-device table's options with less slowdown
    (cheapest first) and keeps the first that still places everything without raising the step
    time, within the search's budget of shard placements. Mutates ``choice``; returns the
    resulting placement.
    """
    trials = _trial_budget(options, choice)
    best = placement
    moved = sorted(
        (t for t in range(len(options)) if options[t][choice[t]].slowdown > 0.0),
        key=lambda t: (-options[t][choice[t]].slowdown, t),
    )
    for t in moved:
        current = options[t][choice[t]]
        better = [k for k, o in enumerate(options[t]) if o.slowdown < current.slowdown]
        for k in better[:ALTERNATIVES_PER_TABLE]:
            if trials <= 0:
                return best
            trials -= 1
            previous, choice[t] = choice[t], k
            result = partition(
                [o[c] for o, c in zip(options, choice, strict=True)], topology, base_bytes
            )
            if isinstance(result, RankAssignment) and result.max_cost <= best.max_cost * (1 + 1e-9):
                best = result
                break
            choice[t] = previous
    return best


def _trial_budget(options: Sequence[Sequence[ShardingOption]], choice: list[int]) -> int:
    """Re-partitions a search may try: `SEARCH_PLACEMENT_BUDGET` shard placements, at least 8."""
    num_shards = sum(len(o[k].shard_sizes) for o, k in zip(options, choice, strict=True))
    return max(8, SEARCH_PLACEMENT_BUDGET // max(1, num_shards))


def improve(
    options: Sequence[Sequence[ShardingOption]],
    choice: list[int],
    placement: RankAssignment,
    topology: Topology,
    base_bytes: Sequence[int],
    max_trials: int | None = None,
) -> RankAssignment:
    """Local search on the slowest rank; mutates ``choice`` and returns the best placement.

    Args:
        options: every table's options, cheapest first.
        choice: the current option index per table (a feasible proposal).
        placement: its placement.
        topology: ranks, hosts, memory.
        base_bytes: per-rank bytes before any shard.
        max_trials: re-partitions allowed (default: from `SEARCH_PLACEMENT_BUDGET`).
    """
    trials = max_trials if max_trials is not None else _trial_budget(options, choice)
    best = placement
    while trials > 0:
        improved = False
        for table, shard_cost in _tables_on_rank(best, best.bottleneck_rank)[:CANDIDATE_TABLES]:
            for k in _alternatives(options[table], choice[table], shard_cost):
                trials -= 1
                previous, choice[table] = choice[table], k
                result = partition(
                    [o[c] for o, c in zip(options, choice, strict=True)], topology, base_bytes
                )
                if isinstance(result, RankAssignment) and result.max_cost < best.max_cost * (
                    1 - 1e-9
                ):
                    best, improved = result, True
                    break
                choice[table] = previous
                if trials <= 0:
                    return best
            if improved:
                break
        if not improved:
            return best
    return best


def _tables_on_rank(placement: RankAssignment, rank: int) -> list[tuple[int, float]]:
    """(table, the cost its shards put on ``rank``), largest first."""
    found = []
    for t, (opt, ranks) in enumerate(zip(placement.options, placement.shard_ranks, strict=True)):
        if opt.is_replicated:
            found.append((t, opt.shard_costs[0]))
            continue
        cost = sum(c for c, r in zip(opt.shard_costs, ranks, strict=True) if r == rank)
        if cost > 0.0:
            found.append((t, cost))
    found.sort(key=lambda tc: (-tc[1], tc[0]))
    return found


def _alternatives(opts: Sequence[ShardingOption], current: int, cost_on_rank: float) -> list[int]:
    """Options whose largest shard costs less than what the table now puts on the slow rank."""
    better = [k for k, o in enumerate(opts) if k != current and max(o.shard_costs) < cost_on_rank]
    return better[:ALTERNATIVES_PER_TABLE]
