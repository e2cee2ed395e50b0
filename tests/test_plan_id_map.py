"""Id-mapped tables need one owner per row (issue 26): column-wise, table-column-wise and
data-parallel shardings are refused, with the table, the type, why and the fix, by
`validate_plan`, `construct_module_sharding_plan`, the sharded collections and the planner; the
planner never proposes them for id-mapped tables and still does for the others."""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import sys
from typing import Any

import pytest

from recopt.modules import EmbeddingBagConfig, EmbeddingConfig, IdMapConfig
from recopt.sharding import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingRequest,
    ShardingType,
    ShardSpec,
    column_wise,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
    validate_plan,
)
from recopt.sharding.plan_helpers import construct_module_sharding_plan
from recopt.sharding.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from recopt.testing import run_on_ranks

GIB = 1024**3
ROOT = pathlib.Path(__file__).resolve().parents[1]
# Written out by hand, the reference: the types that give every row one owner.
ALLOWED = {ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE}
REFUSED = {
    ShardingType.COLUMN_WISE: "splits each row's columns over ranks",
    ShardingType.TABLE_COLUMN_WISE: "splits each row's columns over ranks",
    ShardingType.DATA_PARALLEL: "puts a replica of every row on every rank",
}
FIX = "shard it table_wise, row_wise or table_row_wise, or drop its id_map"
WORLD, RANKS_PER_HOST = 4, 2


def bag(name: str, rows: int = 40, dim: int = 8, mapped: bool = True) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=(f"{name}_f",),
        id_map=IdMapConfig(policy="lru") if mapped else None,
    )


def request(kind: ShardingType) -> ShardingRequest:
    """A request of each type that is valid for an unmapped 40 x 8 table on 4 ranks."""
    return {
        ShardingType.TABLE_WISE: table_wise(1),
        ShardingType.ROW_WISE: row_wise(),
        ShardingType.COLUMN_WISE: column_wise([0, 3]),
        ShardingType.TABLE_ROW_WISE: table_row_wise(1),
        ShardingType.TABLE_COLUMN_WISE: table_column_wise(1),
        ShardingType.DATA_PARALLEL: data_parallel(),
    }[kind]


def check_refusal(message: str, kind: ShardingType, table: str, module: str) -> None:
    assert f"table {table!r} (module {module!r})" in message, message
    assert f"sharding type {kind.value} cannot hold an id-mapped table" in message, message
    assert "one owner per row" in message and REFUSED[kind] in message, message
    assert "would need the whole map" in message, message
    assert FIX in message, message


def test_the_types_that_give_each_row_one_owner() -> None:
    assert {k for k in ShardingType if k.one_owner_per_row} == ALLOWED
    assert set(REFUSED) == set(ShardingType) - ALLOWED
    for kind in ShardingType:
        assert kind.spec.one_owner_per_row == kind.one_owner_per_row


@pytest.mark.parametrize("kind", list(ShardingType), ids=lambda k: k.value)
def test_validate_plan_refuses_column_shards_and_replicas_of_mapped_tables(
    kind: ShardingType,
) -> None:
    mapped, plain = bag("mapped"), bag("plain", mapped=False)
    ps = request(kind).resolve(plain, WORLD, RANKS_PER_HOST)
    # The reference: the same sharding of an unmapped table of the same shape is valid.
    plan = ShardingPlan({"sparse": {"plain": ps, "mapped": table_wise(0).resolve(mapped, WORLD)}})
    validate_plan(plan, {"sparse": [plain, mapped]}, WORLD, RANKS_PER_HOST)
    plan = ShardingPlan({"sparse": {"plain": ps, "mapped": ps}})
    if kind in ALLOWED:
        validate_plan(plan, {"sparse": [plain, mapped]}, WORLD, RANKS_PER_HOST)
        return
    with pytest.raises(PlanError) as error:
        validate_plan(plan, {"sparse": [plain, mapped]}, WORLD, RANKS_PER_HOST)
    check_refusal(str(error.value), kind, "mapped", "sparse")


def test_validate_plan_refuses_row_shards_that_split_the_columns() -> None:
    """A row-wise entry whose shards are half as wide: its rows would have two owners."""
    table = bag("mapped", rows=10, dim=8)
    halves = tuple(
        ShardSpec(rank=r, row_offset=0, num_rows=10, col_offset=4 * r, num_cols=4) for r in (0, 1)
    )
    ps = ParameterSharding(sharding_type=ShardingType.ROW_WISE, ranks=(0, 1), shards=halves)
    with pytest.raises(PlanError) as error:
        validate_plan(ShardingPlan({"m": {"mapped": ps}}), {"m": [table]}, 2)
    message = str(error.value)
    assert "table 'mapped' (module 'm'): an id-mapped table needs one owner per row" in message
    assert "row_wise shard rows 0..10, columns 0..4 on rank 0 splits the columns" in message
    assert "shard it table_wise, row_wise or table_row_wise" in message
    assert "or drop its id_map" in message


@pytest.mark.parametrize("kind", list(ShardingType), ids=lambda k: k.value)
def test_construct_module_sharding_plan_refuses_them(kind: ShardingType) -> None:
    mapped, plain = bag("mapped"), bag("plain", mapped=False)
    requests = {"plain": request(kind), "mapped": request(kind)}
    if kind in ALLOWED:
        plan = construct_module_sharding_plan(
            [plain, mapped], requests, WORLD, RANKS_PER_HOST, module_path="m"
        )
        assert plan["mapped"] == plan["plain"]
        return
    with pytest.raises(PlanError) as error:
        construct_module_sharding_plan(
            [plain, mapped], requests, WORLD, RANKS_PER_HOST, module_path="m"
        )
    check_refusal(str(error.value), kind, "mapped", "m")
    # Without the id map the same requests are a valid plan.
    construct_module_sharding_plan(
        [plain, dataclasses.replace(mapped, id_map=None)],
        requests,
        WORLD,
        RANKS_PER_HOST,
        module_path="m",
    )


def test_construct_refuses_the_type_before_cutting_the_columns() -> None:
    """A width that 3 column shards cannot split: the id-map refusal, not the split error."""
    table = bag("mapped", dim=10)
    with pytest.raises(PlanError) as error:
        construct_module_sharding_plan([table], {"mapped": column_wise([0, 1, 2])}, 3)
    check_refusal(str(error.value), ShardingType.COLUMN_WISE, "mapped", "")
    with pytest.raises(PlanError, match="cannot be split into 3 column shards"):
        plain = dataclasses.replace(table, id_map=None)
        construct_module_sharding_plan([plain], {"mapped": column_wise([0, 1, 2])}, 3)


def _build_sharded(rank: int, world_size: int, pooled: bool) -> dict[str, str]:
    """Each type on one rank, for a mapped table: '' if the module was built, else the error;
    the unmapped twin must build under every type."""
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
    from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection

    requests = {
        ShardingType.TABLE_WISE: table_wise(0),
        ShardingType.ROW_WISE: row_wise(),
        ShardingType.COLUMN_WISE: column_wise([0]),
        ShardingType.TABLE_ROW_WISE: table_row_wise(0),
        ShardingType.TABLE_COLUMN_WISE: table_column_wise(0),
        ShardingType.DATA_PARALLEL: data_parallel(),
    }
    results: dict[str, str] = {}
    for kind, req in requests.items():
        for mapped in (False, True):
            table = bag("t", rows=12, dim=8, mapped=mapped)
            shardings = {"t": req.resolve(table, world_size)}
            try:
                if pooled:
                    ShardedEmbeddingBagCollection([table], shardings, module_path="sparse")
                else:
                    unpooled = EmbeddingConfig(
                        name="t",
                        num_embeddings=12,
                        embedding_dim=8,
                        feature_names=("t_f",),
                        id_map=table.id_map,
                    )
                    ShardedEmbeddingCollection([unpooled], shardings, module_path="sparse")
                message = ""
            except PlanError as e:
                message = str(e)
            results[f"{kind.value}{'/mapped' if mapped else ''}"] = message
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
def test_sharded_collections_refuse_them(pooled: bool) -> None:
    (results,) = run_on_ranks(_build_sharded, 1, pooled)
    for kind in ShardingType:
        assert results[kind.value] == "", (kind, results[kind.value])  # the unmapped reference
        message = results[f"{kind.value}/mapped"]
        if kind in ALLOWED:
            assert message == "", (kind, message)
        else:
            check_refusal(message, kind, "t", "sparse")


def _dmp_refusal(rank: int, world_size: int) -> str:
    from torch import nn

    from recopt.modules import FusedEmbeddingBagCollection
    from recopt.sharding import DistributedModelParallel

    table = bag("t", rows=12, dim=8)
    model = nn.ModuleDict({"sparse": FusedEmbeddingBagCollection([table])})
    plan = ShardingPlan({"sparse": {"t": column_wise([0]).resolve(table, world_size)}})
    try:
        DistributedModelParallel(model, plan, timeout=datetime.timedelta(seconds=60))
    except PlanError as e:
        return str(e)
    return ""


@pytest.mark.multiprocess
def test_distributed_model_parallel_refuses_them() -> None:
    (message,) = run_on_ranks(_dmp_refusal, 1)
    check_refusal(message, ShardingType.COLUMN_WISE, "t", "sparse")


@pytest.mark.parametrize(
    "allowed",
    [
        (ShardingType.COLUMN_WISE,),
        (ShardingType.DATA_PARALLEL,),
        (ShardingType.TABLE_COLUMN_WISE,),
        (ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL),
    ],
    ids=lambda kinds: "+".join(k.value for k in kinds),
)
def test_planner_constraints_that_allow_only_refused_types(
    allowed: tuple[ShardingType, ...],
) -> None:
    constraints = {"mapped": ParameterConstraints(sharding_types=allowed)}
    tables = {
        "m": [bag("mapped", rows=1000, dim=16), bag("plain", rows=1000, dim=16, mapped=False)]
    }
    planner = EmbeddingShardingPlanner(Topology(world_size=4), constraints=constraints)
    with pytest.raises(PlannerError) as error:
        planner.plan(tables)
    assert isinstance(error.value, PlanError)
    message = str(error.value)
    assert message.startswith("table 'mapped' (module 'm'): an id-mapped table needs one owner")
    assert "can be sharded ['table_wise', 'row_wise', 'table_row_wise'] only" in message
    assert f"the constraints allow {[k.value for k in allowed]}" in message
    assert "or drop its id_map" in message
    # The same constraint on the unmapped table is followed.
    plain = {"plain": ParameterConstraints(sharding_types=allowed)}
    plan = EmbeddingShardingPlanner(Topology(world_size=4), constraints=plain).plan(tables)
    assert plan["m"]["plain"].sharding_type in allowed


def test_planner_constraints_keep_the_allowed_types_of_a_mix() -> None:
    kinds = (ShardingType.COLUMN_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL)
    constraints = {"mapped": ParameterConstraints(sharding_types=kinds)}
    plan = EmbeddingShardingPlanner(Topology(world_size=4), constraints=constraints).plan(
        {"m": [bag("mapped", rows=1000, dim=16)]}
    )
    assert plan["m"]["mapped"].sharding_type is ShardingType.ROW_WISE


def test_planner_with_an_optimizer_that_also_limits_the_types() -> None:
    """adafactor runs table_wise or data_parallel only; with an id map, table_wise only."""
    from recopt.kernels.config import FusedOptimizerConfig

    adafactor = FusedOptimizerConfig(name="adafactor")
    c = {"mapped": ParameterConstraints(sharding_types=(ShardingType.DATA_PARALLEL,))}
    with pytest.raises(
        PlannerError, match=r"can be sharded \['table_wise'\] only \(with adafactor"
    ):
        EmbeddingShardingPlanner(
            Topology(world_size=2), constraints=c, default_optimizer=adafactor
        ).plan({"m": [bag("mapped", rows=1000, dim=16)]})


# Table shapes (name, rows, dim, features) and topologies for which the planner, with every
# table unmapped, cuts some table into column shards (found by running it; the reference run
# in the test checks it still does).
SHAPES = (
    ("tiny", 8, 16, 4),
    ("small", 100, 64, 1),
    ("wide", 200_000, 512, 1),
    ("mid", 50_000, 64, 3),
    ("t4", 40_000, 256, 2),
)
PLANNER_MIXES = [
    (2, 0.55, {"wide"}),  # the table the reference splits by columns is mapped
    (2, 0.55, {"tiny", "small", "mid"}),  # the one it splits stays unmapped
    (4, 0.5, {"wide"}),
    (4, 0.5, {"tiny", "small", "mid", "t4"}),
]


def _plan_types(world: int, ddr_gib: float, mapped: set[str]) -> dict[str, ShardingType]:
    tables = [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=tuple(f"{name}_{i}" for i in range(features)),
            id_map=IdMapConfig(policy="lru") if name in mapped else None,
        )
        for name, rows, dim, features in SHAPES
    ]
    topology = Topology(world_size=world, ddr_bytes=int(ddr_gib * GIB))
    plan = EmbeddingShardingPlanner(topology, batch_size=8192).plan({"m": tables})
    validate_plan(plan, {"m": tables}, world)
    return {name: ps.sharding_type for name, ps in plan["m"].items()}


@pytest.mark.parametrize("world, ddr_gib, mapped", PLANNER_MIXES)
def test_planner_gives_mapped_tables_only_allowed_types(
    world: int, ddr_gib: float, mapped: set[str]
) -> None:
    reference = _plan_types(world, ddr_gib, set())
    refused_in_reference = {n for n, k in reference.items() if k not in ALLOWED}
    assert refused_in_reference, reference  # the case exercises the refusal
    mixed = _plan_types(world, ddr_gib, mapped)
    assert {mixed[n] for n in mapped} <= ALLOWED, mixed
    if refused_in_reference & mapped:
        # Those tables were column-sharded without their id map; now they are not.
        assert all(mixed[n] in ALLOWED for n in refused_in_reference & mapped)
    else:
        # Unmapped tables may still be column-sharded or replicated.
        assert any(mixed[n] not in ALLOWED for n in set(mixed) - mapped), mixed


def _dlrm_plan(rank: int, world_size: int) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import dlrm_build
    import dlrm_config

    config = dlrm_config.load_config(
        str(ROOT / "configs" / "dlrm_id_map.toml"), ["training.timeout_s=120"]
    )
    env = dlrm_build.RunEnv(rank=rank, world_size=world_size, local_world_size=world_size)
    model = dlrm_build.build_model(config, env.device)
    dmp: Any = dlrm_build.shard_model(model, config, env)
    assert all(t.id_map is not None for t in config.embedding.tables)
    return {name: ps.sharding_type.value for name, ps in dmp.plan["embedding_bags"].items()}


@pytest.mark.multiprocess
def test_dlrm_id_map_config_plans_allowed_types_on_two_ranks() -> None:
    plans = run_on_ranks(_dlrm_plan, 2, timeout_s=240.0)
    assert plans[0] == plans[1]
    assert sorted(plans[0]) == ["t0", "t1", "t2", "t3"]
    assert {ShardingType(k) for k in plans[0].values()} <= ALLOWED, plans[0]


def test_unpooled_tables_take_the_same_path() -> None:
    """`EmbeddingConfig` tables (embedding collections): validation, hand-written plans and
    the planner refuse the same types."""
    table = EmbeddingConfig(
        name="u", num_embeddings=40, embedding_dim=8, feature_names=("u_f",), id_map=IdMapConfig()
    )
    ps = data_parallel().resolve(table, 2)
    with pytest.raises(PlanError) as error:
        validate_plan(ShardingPlan({"ec": {"u": ps}}), {"ec": [table]}, 2)
    check_refusal(str(error.value), ShardingType.DATA_PARALLEL, "u", "ec")
    with pytest.raises(PlanError) as error:
        construct_module_sharding_plan([table], {"u": column_wise([0, 1])}, 2, module_path="ec")
    check_refusal(str(error.value), ShardingType.COLUMN_WISE, "u", "ec")
    c = {"u": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,))}
    with pytest.raises(PlannerError, match=r"table 'u' \(module 'ec'\): an id-mapped table"):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints=c).plan({"ec": [table]})
    plain = dataclasses.replace(table, id_map=None)
    plan = EmbeddingShardingPlanner(Topology(world_size=2), constraints=c).plan({"ec": [plain]})
    assert plan["ec"]["u"].sharding_type is ShardingType.COLUMN_WISE


def test_recopt_plan_reads_id_maps_from_the_config(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[embedding] id_map` reaches every table without its own (as in the DLRM script), a
    table's `id_map = {...}` is an IdMapConfig, and the planner then refuses CW for them."""
    from recopt.sharding.planner.cli import main, read_config

    tables = read_config(str(ROOT / "configs" / "dlrm_id_map.toml")).tables
    assert [t.id_map for t in tables] == [IdMapConfig(policy="lru")] * 4
    text = (
        "[embedding]\nid_map = { policy = 'lfu' }\n"
        "[[embedding.tables]]\nname = 'a'\nnum_embeddings = 100\nembedding_dim = 16\n"
        "feature_names = ['fa']\n"
        "[[embedding.tables]]\nname = 'b'\nnum_embeddings = 100\nembedding_dim = 16\n"
        "feature_names = ['fb']\nid_map = { policy = 'lru', admit_after = 2 }\n"
        "[planner.constraints.b]\nsharding_types = ['column_wise']\n"
    )
    path = tmp_path / "model.toml"
    path.write_text(text)
    a, b = read_config(str(path)).tables
    assert a.id_map == IdMapConfig(policy="lfu")
    assert b.id_map == IdMapConfig(policy="lru", admit_after=2)
    assert main([str(path), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "table 'b' (module (root)): an id-mapped table needs one owner per row" in err, err
    path.write_text(text.replace("id_map = { policy = 'lru', admit_after = 2 }\n", ""))
    assert read_config(str(path)).tables[1].id_map == IdMapConfig(policy="lfu")
    path.write_text(text.replace("'lfu'", "'lfu', bogus = 1"))
    assert main([str(path), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "entry 0 ('a')" in err and "bogus" in err, err
