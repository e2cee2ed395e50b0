"""The sharding planner: caps, infeasibility, 1-64 ranks, balance, constraints, CLI, collectives."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.registry import OPTIMIZERS
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import ShardingPlan, ShardingType, validate_plan
from recopt.sharding.planner import (
    ConstraintError,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
    TopologyError,
    evaluate_plan,
    local_topology,
)
from recopt.sharding.planner.constraints import TableWorkload
from recopt.sharding.planner.perf import all_to_all_seconds, replica_cost, shard_cost
from recopt.sharding.planner.stats import format_bytes, format_ranks
from recopt.sharding.planner.storage import (
    rank_output_bytes,
    replica_storage_bytes,
    shard_storage_bytes,
)
from recopt.sharding.planner.topology import load_topology_values, topology_from_dict

GIB = 1024**3
EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "planner_example.toml"


def table(name: str, rows: int, dim: int, features: int = 1) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=tuple(f"{name}_f{i}" for i in range(features)),
    )


def random_tables(n: int, seed: int, max_rows: int = 200_000) -> list[EmbeddingBagConfig]:
    rng = random.Random(seed)
    return [
        table(
            f"t{i}", rng.randint(100, max_rows), rng.choice([8, 16, 32, 64, 128]), rng.randint(1, 3)
        )
        for i in range(n)
    ]


def recomputed_rank_bytes(
    plan: ShardingPlan,
    tables_by_module: dict[str, list[EmbeddingBagConfig]],
    topo: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
) -> list[int]:
    """Per-rank bytes from the plan itself and the storage formulas (not the planner's books)."""
    used = [0] * topo.world_size
    for module, tables in tables_by_module.items():
        for t in tables:
            ps = plan[module][t.name]
            w = TableWorkload(
                batch_size=batch_size,
                num_features=len(t.feature_names),
                pooling_factor=1.0,
                optimizer=ps.optimizer or optimizer,
            )
            for r in range(topo.world_size):
                used[r] += rank_output_bytes(t.embedding_dim, w)
            if ps.sharding_type.replicated:
                for r in ps.ranks:
                    used[r] += replica_storage_bytes(
                        t.num_embeddings, t.embedding_dim, w, topo.world_size
                    )
            for s in ps.shards:
                used[s.rank] += shard_storage_bytes(
                    ps.sharding_type, s.num_rows, s.num_cols, t.num_embeddings, w, topo.world_size
                )
    return used


# --------------------------------------------------------------------------------------------
# plans: caps, validity, JSON, 1 to 64 ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 17, 64])
def test_plans_for_1_to_64_ranks_are_valid_under_caps_and_round_trip(world_size: int) -> None:
    tables = {"sparse.ebc": random_tables(60, seed=world_size), "": [table("tiny", 10, 4)]}
    topo = Topology(world_size=world_size, ranks_per_host=8, ddr_bytes=2 * GIB)
    planner = EmbeddingShardingPlanner(topo, batch_size=256)
    plan = planner.plan(tables)
    validate_plan(plan, tables, world_size, topo.local_world_size)
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    validate_plan(again, tables, world_size, topo.local_world_size)
    assert planner.stats is not None
    used = recomputed_rank_bytes(plan, tables, topo, 256, FusedOptimizerConfig())
    assert used == list(planner.stats.rank_bytes)
    assert max(used) <= topo.usable_bytes


def test_memory_tight_plan_spreads_a_big_table_and_stays_under_caps() -> None:
    big = table("big", 3_000_000, 64)  # 768 MiB of weights: more than one rank's 512 MiB
    tables = {"m": [big, *random_tables(20, seed=1, max_rows=50_000)]}
    topo = Topology(world_size=4, ddr_bytes=600 * 2**20, reserve_fraction=0.05)
    planner = EmbeddingShardingPlanner(topo, batch_size=64)
    plan = planner.plan(tables)
    assert len(plan["m"]["big"].shards) > 1
    used = recomputed_rank_bytes(plan, tables, topo, 64, FusedOptimizerConfig())
    assert max(used) <= topo.usable_bytes
    validate_plan(plan, tables, 4)


def test_adam_state_is_counted() -> None:
    """The optimizer's state decides feasibility: a table fits with sgd but not with adam."""
    tables = {"m": [table("t", 1_000_000, 64)]}  # 244 MiB of weights
    topo = Topology(world_size=1, ddr_bytes=600 * 2**20, reserve_fraction=0.0)
    EmbeddingShardingPlanner(
        topo, batch_size=8, default_optimizer=FusedOptimizerConfig(name="sgd")
    ).plan(tables)
    adam = EmbeddingShardingPlanner(
        topo, batch_size=8, default_optimizer=FusedOptimizerConfig(name="adam")
    )
    with pytest.raises(PlannerError, match=r"less state \(now: 'adam' on 1 tables"):
        adam.plan(tables)


def test_too_little_memory_in_total_fails_at_once_naming_the_largest_tables() -> None:
    tables = {"sparse.ebc": [table("small", 1000, 16), table("huge", 50_000_000, 128)]}
    topo = Topology(world_size=2, ddr_bytes=1 * GIB)
    with pytest.raises(PlannerError) as info:
        EmbeddingShardingPlanner(topo, batch_size=32).plan(tables)
    message = str(info.value)
    # 50M x 128 float32 weights = 23.84 GiB, plus one row-wise Adagrad float per row.
    assert "the tables need at least 24.03 GiB in total but the 2 ranks have 1.80 GiB" in message
    assert "(921.60 MiB usable per rank of 1.00 GiB, less 36.00 KiB per rank" in message
    assert "Largest tables: 'huge' (module 'sparse.ebc') 24.03 GiB, 'small'" in message
    assert "short by 22.23 GiB" in message and "To fit: add ranks or memory per rank" in message


def test_a_table_too_big_for_any_rank_is_named_with_its_shortfall() -> None:
    """Enough memory in total, but the only allowed layout puts the table on one rank."""
    big = table("big", 3_000_000, 64)  # ~790 MiB with row-wise Adagrad and buffers
    tables = {"sparse.ebc": [big, table("small", 1000, 16)]}
    topo = Topology(world_size=2, ddr_bytes=600 * 2**20, reserve_fraction=0.0)
    tw = {"big": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,))}
    with pytest.raises(PlannerError) as info:
        EmbeddingShardingPlanner(topo, constraints=tw, batch_size=32).plan(tables)
    message = str(info.value)
    assert message.startswith("table 'big' (module 'sparse.ebc') does not fit: its layout ")
    assert "table_wise needs 743.91 MiB on one rank, but the rank with the most room" in message
    assert "free of 600.00 MiB usable (600.00 MiB less the 0% reserve" in message
    assert "short by 143.93 MiB" in message
    assert "allow more sharding types for this table" in message
    # Allowing row-wise fixes it.
    EmbeddingShardingPlanner(topo, batch_size=32).plan(tables)


def test_evaluate_plan_agrees_with_the_planners_own_books() -> None:
    tables = {"a": random_tables(30, seed=21), "b": [table("wide", 20_000, 64, features=3)]}
    adam = FusedOptimizerConfig(name="adam")
    constraints = {
        "t0": ParameterConstraints(sharding_types=(ShardingType.DATA_PARALLEL,)),
        "t1": ParameterConstraints(sharding_types=(ShardingType.ROW_WISE,), pooling_factor=3.0),
        "wide": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,), batch_size=64),
        "t2": ParameterConstraints(sharding_types=(ShardingType.TABLE_ROW_WISE,), optimizer=adam),
    }
    topo = Topology(world_size=8, ranks_per_host=4, ddr_bytes=GIB)
    modules = {"a": {"t3": FusedOptimizerConfig(name="adagrad")}}
    planner = EmbeddingShardingPlanner(topo, constraints=constraints, batch_size=128)
    plan = planner.plan(tables, modules)
    stats = evaluate_plan(plan, tables, topo, 128, None, modules, constraints)
    assert planner.stats is not None
    assert stats.rank_bytes == planner.stats.rank_bytes
    assert stats.rank_seconds == pytest.approx(planner.stats.rank_seconds, rel=1e-12)
    ours = {(c.module, c.table): c for c in stats.tables}
    for c in planner.stats.tables:
        assert ours[c.module, c.table].bytes == c.bytes
        assert ours[c.module, c.table].seconds == pytest.approx(c.seconds, rel=1e-12)


def test_planning_is_deterministic() -> None:
    tables = {"m": random_tables(200, seed=5)}
    topo = Topology(world_size=16, ranks_per_host=4, ddr_bytes=4 * GIB)
    a = EmbeddingShardingPlanner(topo).plan(tables)
    b = EmbeddingShardingPlanner(topo).plan(tables)
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize(("num_tables", "world_size"), [(200, 8), (500, 16), (1000, 64)])
def test_balanced_sets_within_10_percent_of_lower_bound(num_tables: int, world_size: int) -> None:
    rng = random.Random(num_tables)
    tables = {
        "m": [
            table(f"t{i}", rng.randint(50_000, 100_000), 64, rng.randint(1, 2))
            for i in range(num_tables)
        ]
    }
    topo = Topology(world_size=world_size, ranks_per_host=8, ddr_bytes=8 * GIB)
    planner = EmbeddingShardingPlanner(topo, batch_size=512)
    planner.plan(tables)
    assert planner.stats is not None
    ratio = planner.stats.max_seconds / planner.stats.lower_bound_seconds
    assert 1.0 <= ratio <= 1.10, ratio


def test_one_dominant_table_gets_split() -> None:
    """A table costing more than the average rank load is spread so the step time drops."""
    tables = {
        "m": [table("hot", 100_000, 128, features=8), *random_tables(7, seed=3, max_rows=1000)]
    }
    topo = Topology(world_size=8, ddr_bytes=4 * GIB)
    planner = EmbeddingShardingPlanner(topo)
    plan = planner.plan(tables)
    assert len(plan["m"]["hot"].ranks) > 1
    tw_only = EmbeddingShardingPlanner(
        topo, constraints={"hot": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,))}
    )
    tw_only.plan(tables)
    assert planner.stats is not None and tw_only.stats is not None
    assert planner.stats.max_seconds < tw_only.stats.max_seconds


# --------------------------------------------------------------------------------------------
# constraints


def test_constraints_are_honoured() -> None:
    tables = {
        "a": [table("x", 100_000, 64), table("y", 100_000, 64), table("z", 5000, 32)],
        "b": [table("x", 1000, 16)],
    }
    adam = FusedOptimizerConfig(name="adam", lr=0.002)
    constraints = {
        "a.x": ParameterConstraints(sharding_types=(ShardingType.ROW_WISE,)),
        "y": ParameterConstraints(
            sharding_types=(ShardingType.COLUMN_WISE,), min_partition=32, optimizer=adam
        ),
        "z": ParameterConstraints(
            backends=(Backend.FBGEMM,), sharding_types=(ShardingType.DATA_PARALLEL,)
        ),
        "b.x": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,)),
    }
    topo = Topology(world_size=4, ddr_bytes=4 * GIB)
    plan = EmbeddingShardingPlanner(topo, constraints=constraints).plan(tables)
    assert plan["a"]["x"].sharding_type is ShardingType.ROW_WISE
    y = plan["a"]["y"]
    assert y.sharding_type is ShardingType.COLUMN_WISE and y.optimizer == adam
    assert all(s.num_cols >= 32 for s in y.shards)
    assert plan["a"]["z"].sharding_type is ShardingType.DATA_PARALLEL
    assert plan["a"]["z"].backend is Backend.FBGEMM
    assert plan["b"]["x"].sharding_type is ShardingType.TABLE_WISE


def test_module_qualified_constraint_wins_over_bare_name() -> None:
    tables = {"a.sub": [table("x", 5000, 16)], "b": [table("x", 5000, 16)]}
    constraints = {
        "x": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,)),
        "a.sub.x": ParameterConstraints(sharding_types=(ShardingType.ROW_WISE,)),
    }
    plan = EmbeddingShardingPlanner(Topology(world_size=2), constraints=constraints).plan(tables)
    assert plan["a.sub"]["x"].sharding_type is ShardingType.ROW_WISE
    assert plan["b"]["x"].sharding_type is ShardingType.TABLE_WISE


def test_explicit_column_wise_on_a_narrow_table_is_one_full_height_shard() -> None:
    c = {"t": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,), min_partition=4)}
    plan = EmbeddingShardingPlanner(Topology(world_size=2), constraints=c).plan(
        {"m": [table("t", 100, 6)]}
    )
    ps = plan["m"]["t"]
    assert ps.sharding_type is ShardingType.COLUMN_WISE
    assert [(s.num_rows, s.num_cols) for s in ps.shards] == [(100, 6)]


def test_adafactor_only_table_wise_or_data_parallel() -> None:
    tables = {"m": [table("big", 200_000, 64, features=4), *random_tables(3, seed=4)]}
    adafactor = FusedOptimizerConfig(name="adafactor")
    topo = Topology(world_size=8, ddr_bytes=4 * GIB)
    plan = EmbeddingShardingPlanner(topo, default_optimizer=adafactor).plan(tables)
    kinds = {ps.sharding_type for ps in plan["m"].values()}
    assert kinds <= {ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL}
    c = {"big": ParameterConstraints(sharding_types=(ShardingType.ROW_WISE,), optimizer=adafactor)}
    with pytest.raises(
        PlannerError,
        match=r"table 'big' \(module 'm'\): the fused optimizer "
        "adafactor supports table_wise and data_parallel sharding only",
    ):
        EmbeddingShardingPlanner(topo, constraints=c).plan(tables)


def test_fbgemm_not_offered_for_column_shards_of_row_wise_optimizers() -> None:
    c = {
        "t": ParameterConstraints(
            sharding_types=(ShardingType.COLUMN_WISE,), backends=(Backend.FBGEMM,)
        )
    }
    with pytest.raises(PlannerError, match="fbgemm cannot run 'row_wise_adagrad' on column shards"):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints=c).plan(
            {"m": [table("t", 99, 64)]}
        )
    c["t"] = dataclasses.replace(c["t"], backends=(Backend.FBGEMM, Backend.RECOPT))
    plan = EmbeddingShardingPlanner(Topology(world_size=2), constraints=c).plan(
        {"m": [table("t", 99, 64)]}
    )
    assert plan["m"]["t"].backend is Backend.RECOPT


def test_module_optimizers_drive_estimates_but_stay_out_of_the_plan() -> None:
    tables = {"m": [table("t", 100_000, 64)]}
    topo = Topology(world_size=2)
    c = {"t": ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,))}
    rw = EmbeddingShardingPlanner(topo, constraints=c)
    plan_rw = rw.plan(tables)
    adam = EmbeddingShardingPlanner(topo, constraints=c)
    plan_adam = adam.plan(tables, {"m": {"t": FusedOptimizerConfig(name="adam")}})
    assert plan_rw["m"]["t"].optimizer is None and plan_adam["m"]["t"].optimizer is None
    assert rw.stats is not None and adam.stats is not None
    extra = sum(adam.stats.rank_bytes) - sum(rw.stats.rank_bytes)
    assert extra == 4 * (2 * 100_000 * 64 - 100_000)  # adam's 2 floats per weight vs 1 per row


def test_every_planned_sharding_is_accepted_by_the_sharded_layout() -> None:
    """Contract with recopt/sharding/layout.py: the planner proposes nothing it rejects."""
    layout = pytest.importorskip("recopt.sharding.layout")
    tables = random_tables(12, seed=11) + [table("wide", 50_000, 128, features=6)]
    for name in sorted(OPTIMIZERS):  # every fused optimizer of the registry
        optimizer = FusedOptimizerConfig(name=name)
        for world_size, kernels in ((4, None), (8, (Backend.FBGEMM, Backend.RECOPT))):
            c = {t.name: ParameterConstraints(backends=kernels) for t in tables} if kernels else {}
            topo = Topology(world_size=world_size, ranks_per_host=4, ddr_bytes=4 * GIB)
            plan = EmbeddingShardingPlanner(topo, constraints=c, default_optimizer=optimizer).plan(
                {"m": tables}
            )
            for t in tables:
                layout.resolve_optimizer(t, plan["m"][t.name], optimizer, "m")


def test_host_types_stay_on_one_host() -> None:
    tables = {"m": [table("r", 10_000, 32), table("c", 10_000, 64)]}
    constraints = {
        "r": ParameterConstraints(sharding_types=(ShardingType.TABLE_ROW_WISE,)),
        "c": ParameterConstraints(sharding_types=(ShardingType.TABLE_COLUMN_WISE,)),
    }
    topo = Topology(world_size=8, ranks_per_host=4, ddr_bytes=GIB)
    plan = EmbeddingShardingPlanner(topo, constraints=constraints).plan(tables)
    for name in ("r", "c"):
        assert len({r // 4 for r in plan["m"][name].ranks}) == 1
    assert len(plan["m"]["r"].ranks) == 4


def test_pooling_factor_and_batch_size_change_estimates() -> None:
    tables = {"m": [table("t", 10_000, 32)]}
    topo = Topology(world_size=2, ddr_bytes=GIB)

    def step(c: ParameterConstraints) -> float:
        planner = EmbeddingShardingPlanner(topo, constraints={"t": c})
        planner.plan(tables)
        assert planner.stats is not None
        return planner.stats.max_seconds

    base = step(ParameterConstraints())
    assert step(ParameterConstraints(pooling_factor=10.0)) > base
    assert step(ParameterConstraints(batch_size=4096)) > base


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ({"nope": ParameterConstraints()}, r"constraints name table 'nope', which no module has"),
        (
            {
                "t": ParameterConstraints(
                    backends=(Backend.FBGEMM,), optimizer=FusedOptimizerConfig(name="adam")
                )
            },
            r"table 't' \(module 'm'\): no allowed kernel can run it: "
            "fbgemm does not run optimizer 'adam' on cpu",
        ),
        (
            {"t": ParameterConstraints(backends=(Backend.FBGEMM,))},
            "fbgemm needs shard widths that are multiples of 4, not 6",
        ),
    ],
)
def test_constraint_errors(constraints: dict[str, ParameterConstraints], message: str) -> None:
    topo = Topology(world_size=2)
    with pytest.raises(PlannerError, match=message):
        EmbeddingShardingPlanner(topo, constraints=constraints).plan({"m": [table("t", 100, 6)]})


def test_fbgemm_adam_is_offered_on_cuda_topologies_without_weight_decay() -> None:
    topo = Topology(world_size=2, device="cuda", hbm_bytes=8 * GIB)
    only_fbgemm = ParameterConstraints(backends=(Backend.FBGEMM,))
    for name in ("adam", "row_wise_adam"):
        plan = EmbeddingShardingPlanner(topo, constraints={"t": only_fbgemm}).plan(
            {"m": [table("t", 100, 8)]}, {"m": {"t": FusedOptimizerConfig(name=name)}}
        )
        assert plan["m"]["t"].backend == Backend.FBGEMM
        decayed = {"m": {"t": FusedOptimizerConfig(name=name, weight_decay=0.1)}}
        with pytest.raises(PlannerError, match="decays weights decoupled"):
            EmbeddingShardingPlanner(topo, constraints={"t": only_fbgemm}).plan(
                {"m": [table("t", 100, 8)]}, decayed
            )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_types": ("diagonal",)}, "'diagonal' is not a valid ShardingType"),
        ({"backends": ()}, "an empty list allows nothing"),
        ({"min_partition": 0}, "min_partition must be >= 1, got 0"),
        ({"pooling_factor": 0.0}, "pooling_factor must be > 0, got 0.0"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ],
)
def test_parameter_constraints_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConstraintError, match=message):
        ParameterConstraints(**kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# topology


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"world_size": 2, "ranks_per_host": 0}, "ranks_per_host must be an int >= 1, got 0"),
        ({"world_size": 2, "device": "tpu"}, "device 'tpu' is unknown"),
        (
            {"world_size": 2, "reserve_fraction": 1.0},
            r"reserve_fraction must be in \[0, 1\), got 1.0",
        ),
        ({"world_size": 2, "memory_bandwidth": 0.0}, "memory_bandwidth must be > 0 bytes/s"),
        ({"world_size": 2, "device": "cuda"}, "hbm_bytes is 0 for device 'cuda'"),
        ({"world_size": 2, "ddr_bytes": -1}, "ddr_bytes must be an int >= 0, got -1"),
    ],
)
def test_topology_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_local_topology_uses_this_machines_memory() -> None:
    topo = local_topology(4, ranks_per_host=2, device="cpu")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert topo.device == "cpu" and topo.ddr_bytes == physical // 2 and topo.num_hosts == 2
    assert local_topology(3, device="cpu").ddr_bytes == physical // 3


def test_topology_hosts_and_file_round_trip(tmp_path: Path) -> None:
    topo = Topology(world_size=10, ranks_per_host=4, ddr_bytes=3 * GIB, inter_host_bandwidth=2e9)
    assert topo.num_hosts == 3 and list(topo.host_ranks(2)) == [8, 9]
    path = tmp_path / "topo.toml"
    path.write_text(topo.to_toml())
    assert topology_from_dict(load_topology_values(path), str(path)) == topo
    (tmp_path / "t.json").write_text(json.dumps({"world_size": 3, "ddr_bytes": 1024}))
    assert topology_from_dict(load_topology_values(tmp_path / "t.json"), "t").world_size == 3
    with pytest.raises(TopologyError, match=r"unknown topology keys \['nics'\]"):
        topology_from_dict({"nics": 2, "world_size": 1}, "f")
    with pytest.raises(TopologyError, match="world_size is not set"):
        topology_from_dict({}, "f")
    with pytest.raises(TopologyError, match="cannot be read"):
        load_topology_values(tmp_path / "missing.toml")


# --------------------------------------------------------------------------------------------
# estimators


def test_cost_model_shapes() -> None:
    w = TableWorkload(
        batch_size=512, num_features=1, pooling_factor=4.0, optimizer=FusedOptimizerConfig()
    )
    one = Topology(world_size=1)
    eight = Topology(world_size=8)
    tw1 = shard_cost(ShardingType.TABLE_WISE, 1000, 64, 1000, w, one)
    assert tw1.fwd_comm == 0.0 and tw1.bwd_comm == 0.0 and tw1.fwd_compute > 0
    tw8 = shard_cost(ShardingType.TABLE_WISE, 1000, 64, 1000, w, eight)
    rw8 = shard_cost(ShardingType.ROW_WISE, 125, 64, 1000, w, eight)
    # A row shard looks up 1/8 of the ids but still reduces pooled partial sums of every bag.
    assert rw8.fwd_compute < tw8.fwd_compute and rw8.bwd_comm == pytest.approx(tw8.bwd_comm)
    # A replica pools the global batch on every rank: a table-wise shard's work without the
    # forward output exchange, whatever the table's size (sparse update, no dense all-reduce).
    dp8 = replica_cost(1000, 64, w, eight)
    assert dp8.fwd_compute == tw8.fwd_compute and dp8.bwd_compute == tw8.bwd_compute
    assert dp8.bwd_comm == tw8.bwd_comm and dp8.fwd_comm < tw8.fwd_comm
    assert replica_cost(10_000_000, 64, w, eight).bwd_comm == dp8.bwd_comm
    # Row-wise optimizers on column shards exchange a partial row statistic per id.
    cw = shard_cost(ShardingType.COLUMN_WISE, 1000, 32, 1000, w, eight, column_shards=2)
    sgd = TableWorkload(
        batch_size=512,
        num_features=1,
        pooling_factor=4.0,
        optimizer=FusedOptimizerConfig(name="sgd"),
    )
    cw_sgd = shard_cost(ShardingType.COLUMN_WISE, 1000, 32, 1000, sgd, eight, column_shards=2)
    ids = 8 * 512 * 4.0
    assert cw.bwd_comm - cw_sgd.bwd_comm == pytest.approx(all_to_all_seconds(4 * ids, eight))


def test_storage_counts_optimizer_state() -> None:
    def bytes_for(name: str) -> int:
        w = TableWorkload(
            batch_size=1,
            num_features=1,
            pooling_factor=1.0,
            optimizer=FusedOptimizerConfig(name=name),
        )
        return shard_storage_bytes(ShardingType.TABLE_WISE, 1000, 16, 1000, w, 1)

    sgd = bytes_for("sgd")
    assert bytes_for("adagrad") - sgd == 4 * 1000 * 16
    assert bytes_for("row_wise_adagrad") - sgd == 4 * 1000
    assert bytes_for("adam") - sgd == 4 * 2 * 1000 * 16
    assert bytes_for("row_wise_adam") - sgd == 4 * (1000 * 16 + 1000)
    assert bytes_for("lamb") - sgd == 4 * 2 * 1000 * 16
    assert bytes_for("row_wise_lamb") - sgd == 4 * (1000 * 16 + 1000)
    assert bytes_for("adafactor") - sgd == 4 * (1000 + 16)


def test_format_helpers_and_stats_text() -> None:
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B"
    assert format_ranks((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    planner = EmbeddingShardingPlanner(Topology(world_size=2))
    planner.plan({"m": random_tables(5, seed=2)})
    text = str(planner.stats)
    assert "estimated step" in text and "rank" in text and "t0" in text


def test_planner_argument_errors() -> None:
    with pytest.raises(PlannerError, match="batch_size must be >= 1, got 0"):
        EmbeddingShardingPlanner(Topology(world_size=1), batch_size=0)
    with pytest.raises(PlannerError, match="nothing to plan"):
        EmbeddingShardingPlanner(Topology(world_size=1)).plan({"m": []})


def test_dataclass_configs_are_frozen() -> None:
    for cls in (Topology, ParameterConstraints):
        assert dataclasses.is_dataclass(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Topology(world_size=1).world_size = 2  # type: ignore[misc]
