"""Partitioner and proposers on hand-made options: fallbacks, failures, memory repair, search."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import ShardingType, validate_plan
from recopt.sharding.planner import EmbeddingShardingPlanner, PlannerError, Topology, evaluate_plan
from recopt.sharding.planner.enumerator import ShardingOption
from recopt.sharding.planner.partitioner import AssignmentFailure, RankAssignment, partition
from recopt.sharding.planner.proposers import greedy_proposal, improve, make_feasible


@dataclass(frozen=True)
class T:
    name: str
    num_embeddings: int = 10
    embedding_dim: int = 4


def tw(name: str, nbytes: int, cost: float) -> ShardingOption:
    return ShardingOption(
        module="m",
        table=T(name),
        sharding_type=ShardingType.TABLE_WISE,
        backend=Backend.AUTO,
        optimizer=FusedOptimizerConfig(),
        shard_sizes=[(10, 4)],
        shard_bytes=[nbytes],
        shard_costs=[cost],
        fixed_ranks=None,
    )


def rw(name: str, nbytes: list[int], costs: list[float]) -> ShardingOption:
    return ShardingOption(
        module="m",
        table=T(name),
        sharding_type=ShardingType.ROW_WISE,
        backend=Backend.AUTO,
        optimizer=FusedOptimizerConfig(),
        shard_sizes=[(5, 4)] * len(nbytes),
        shard_bytes=nbytes,
        shard_costs=costs,
        fixed_ranks=list(range(len(nbytes))),
    )


def dp(name: str, nbytes: int, cost: float, world_size: int) -> ShardingOption:
    return ShardingOption(
        module="m",
        table=T(name),
        sharding_type=ShardingType.DATA_PARALLEL,
        backend=Backend.AUTO,
        optimizer=FusedOptimizerConfig(),
        shard_sizes=[(10, 4)],
        shard_bytes=[nbytes],
        shard_costs=[cost],
        fixed_ranks=list(range(world_size)),
    )


def two_ranks(cap: int) -> Topology:
    return Topology(world_size=2, ddr_bytes=cap, reserve_fraction=0.0)


def test_lpt_balances_cost() -> None:
    options = [tw("a", 1, 5.0), tw("b", 1, 4.0), tw("c", 1, 3.0), tw("d", 1, 2.0)]
    result = partition(options, two_ranks(100), [0, 0])
    assert isinstance(result, RankAssignment)
    assert result.shard_ranks == [[0], [1], [1], [0]]
    assert result.rank_cost == [7.0, 7.0] and result.rank_bytes == [2, 2]


def test_memory_first_pass_rescues_a_fragmented_packing() -> None:
    # Cost order puts both 4-byte shards on rank 1, leaving no room for the last 6-byte one;
    # largest-first by bytes packs 6+4 | 6+4.
    options = [tw("a", 6, 4.0), tw("b", 4, 3.0), tw("c", 4, 2.0), tw("d", 6, 1.0)]
    result = partition(options, two_ranks(10), [0, 0])
    assert isinstance(result, RankAssignment)
    assert sorted(result.rank_bytes) == [10, 10]


def test_failure_names_the_shard_and_the_roomiest_rank() -> None:
    options = [tw("a", 6, 4.0), tw("b", 6, 3.0), tw("c", 5, 2.0)]
    result = partition(options, two_ranks(10), [1, 0])
    assert isinstance(result, AssignmentFailure)
    assert result.option_index == 2 and result.needed_bytes == 5
    assert result.best_rank == 1 and result.free_bytes == 4


def test_replicas_and_row_shards_use_their_fixed_ranks() -> None:
    options = [dp("d", 3, 1.0, 2), rw("r", [2, 1], [0.5, 0.25]), tw("t", 1, 2.0)]
    result = partition(options, two_ranks(10), [0, 0])
    assert isinstance(result, RankAssignment)
    assert result.shard_ranks == [[0, 1], [0, 1], [1]]
    assert result.rank_bytes == [5, 5] and result.rank_cost == [1.5, 3.25]


def test_replica_overflow_is_reported_on_the_fullest_rank() -> None:
    options = [dp("d1", 4, 1.0, 2), dp("d2", 4, 1.0, 2)]
    result = partition(options, two_ranks(10), [0, 3])
    assert isinstance(result, AssignmentFailure)
    assert result.option_index == 1 and result.best_rank == 1 and result.free_bytes == 3


def test_make_feasible_spreads_another_table_when_the_failing_one_cannot_shrink() -> None:
    options = [
        [tw("y", 8, 1.0), rw("y", [4, 4], [1.0, 1.0])],
        [tw("x", 6, 0.5)],
        [tw("z", 6, 0.4)],
    ]
    choice = greedy_proposal(options, capacity=10)
    assert choice == [0, 0, 0]
    result = make_feasible(options, choice, two_ranks(10), [0, 0])
    assert isinstance(result, RankAssignment) and choice == [1, 0, 0]
    assert result.rank_bytes == [10, 10]


def test_make_feasible_gives_up_with_the_failure() -> None:
    options = [[tw("x", 8, 1.0)], [tw("y", 8, 1.0)], [tw("z", 8, 1.0)]]
    result = make_feasible(options, [0, 0, 0], two_ranks(10), [0, 0])
    assert isinstance(result, AssignmentFailure) and result.option_index == 2


def test_greedy_skips_options_too_big_for_an_empty_rank() -> None:
    options = [
        [tw("x", 20, 1.0), rw("x", [10, 10], [2.0, 2.0])],
        [tw("y", 30, 1.0), tw("y", 40, 2.0)],
    ]
    assert greedy_proposal(options, capacity=15) == [1, 0]


def test_search_splits_the_table_that_dominates_the_slowest_rank() -> None:
    options = [
        [tw("hot", 1, 10.0), rw("hot", [1, 1], [3.0, 3.0])],
        [tw("a", 1, 1.0)],
        [tw("b", 1, 1.0)],
    ]
    choice = [0, 0, 0]
    start = partition([o[0] for o in options], two_ranks(100), [0, 0])
    assert isinstance(start, RankAssignment) and start.max_cost == 10.0
    best = improve(options, choice, start, two_ranks(100), [0, 0])
    assert choice[0] == 1 and best.max_cost == 4.0


def test_search_respects_its_trial_budget() -> None:
    options = [[tw("hot", 1, 10.0), rw("hot", [1, 1], [3.0, 3.0])], [tw("a", 1, 1.0)]]
    start = partition([o[0] for o in options], two_ranks(100), [0, 0])
    assert isinstance(start, RankAssignment)
    choice = [0, 0]
    best = improve(options, choice, start, two_ranks(100), [0, 0], max_trials=0)
    assert best is start and choice == [0, 0]


# --------------------------------------------------------------------------------------------
# property: any input gives a valid plan under the caps, or a PlannerError that names a table


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.integers(1, 300_000), st.sampled_from([1, 4, 6, 8, 16, 64, 128]), st.integers(1, 3)
        ),
        min_size=1,
        max_size=12,
    ),
    world_size=st.integers(1, 16),
    ranks_per_host=st.sampled_from([None, 1, 2, 4]),
    memory_mib=st.sampled_from([8, 64, 512, 4096]),
    optimizer=st.sampled_from(["sgd", "row_wise_adagrad", "adam", "adafactor"]),
)
def test_any_input_plans_validly_or_explains(
    shapes: list[tuple[int, int, int]],
    world_size: int,
    ranks_per_host: int | None,
    memory_mib: int,
    optimizer: str,
) -> None:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=tuple(f"f{i}_{k}" for k in range(features)),
        )
        for i, (rows, dim, features) in enumerate(shapes)
    ]
    topo = Topology(
        world_size=world_size, ranks_per_host=ranks_per_host, ddr_bytes=memory_mib * 2**20
    )
    planner = EmbeddingShardingPlanner(
        topo, batch_size=64, default_optimizer=FusedOptimizerConfig(name=optimizer)
    )
    try:
        plan = planner.plan({"m": tables})
    except PlannerError as e:
        assert "table" in str(e) and "To fit" in str(e)
        return
    validate_plan(plan, {"m": tables}, world_size, topo.local_world_size)
    assert planner.stats is not None
    assert max(planner.stats.rank_bytes) <= topo.usable_bytes
    again = evaluate_plan(plan, {"m": tables}, topo, 64, FusedOptimizerConfig(name=optimizer))
    assert again.rank_bytes == planner.stats.rank_bytes
    if optimizer == "adafactor":
        kinds = {ps.sharding_type for ps in plan["m"].values()}
        assert kinds <= {ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL}
