"""Sharding plan types: helpers on uneven shapes, JSON round trips, every validation error."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.sharding import (
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingRequest,
    ShardingType,
    ShardSpec,
    balanced_table_wise_plan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    split_columns,
    table_column_wise,
    table_row_wise,
    table_wise,
    validate_plan,
)


@dataclass(frozen=True)
class Table:
    """Stand-in for recopt.modules.EmbeddingBagConfig (the plan only reads the shape)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)


def spans(ps: ParameterSharding) -> list[tuple[int, int, int, int, int]]:
    return [dataclasses.astuple(s) for s in ps.shards]


def one(
    table: Table, request: ShardingRequest, world_size: int, rph: int | None = None
) -> ParameterSharding:
    shardings = construct_module_sharding_plan([table], {table.name: request}, world_size, rph)
    return shardings[table.name]


# --------------------------------------------------------------------------------------------
# helpers


def test_table_wise_is_one_full_shard() -> None:
    ps = one(Table("t", 10, 6), table_wise(2), 4)
    assert ps.sharding_type is ShardingType.TABLE_WISE
    assert ps.ranks == (2,)
    assert spans(ps) == [(2, 0, 10, 0, 6)]


def test_row_wise_uneven_rows_first_shards_one_larger() -> None:
    ps = one(Table("t", 10, 8), row_wise(), 4)
    assert ps.ranks == (0, 1, 2, 3)
    assert spans(ps) == [(0, 0, 3, 0, 8), (1, 3, 3, 0, 8), (2, 6, 2, 0, 8), (3, 8, 2, 0, 8)]


def test_row_wise_fewer_rows_than_ranks_leaves_extra_ranks_empty() -> None:
    ps = one(Table("t", 2, 8), row_wise(), 5)
    assert ps.ranks == (0, 1)
    assert spans(ps) == [(0, 0, 1, 0, 8), (1, 1, 1, 0, 8)]


def test_row_wise_explicit_ranks_in_order() -> None:
    ps = one(Table("t", 7, 4), row_wise([3, 1]), 4)
    assert ps.ranks == (1, 3)
    assert spans(ps) == [(3, 0, 4, 0, 4), (1, 4, 3, 0, 4)]


def test_column_wise_equal_multiples_of_four_and_repeated_ranks() -> None:
    ps = one(Table("t", 5, 32), column_wise([1, 0, 1, 0]), 2)
    assert ps.ranks == (0, 1)
    assert spans(ps) == [(1, 0, 5, 0, 8), (0, 0, 5, 8, 8), (1, 0, 5, 16, 8), (0, 0, 5, 24, 8)]


def test_column_wise_near_equal_multiples_of_four() -> None:
    assert split_columns(20, 2) == [12, 8]
    assert split_columns(40, 3) == [16, 12, 12]


def test_column_wise_equal_widths_when_dim_not_multiple_of_four() -> None:
    ps = one(Table("t", 5, 6), column_wise([0, 1]), 2)
    assert [s.num_cols for s in ps.shards] == [3, 3]


def test_column_wise_impossible_split_is_clear() -> None:
    with pytest.raises(
        PlanError, match=r"table 't' \(module ''\): embedding_dim 7 cannot be split into 2"
    ):
        one(Table("t", 5, 7), column_wise([0, 1]), 2)


def test_column_wise_fbgemm_odd_width_rejected_by_validation() -> None:
    with pytest.raises(PlanError, match="shard width 3 is not a multiple of 4.*fbgemm"):
        one(Table("t", 5, 6), column_wise([0, 1], backend=Backend.FBGEMM), 2)


def test_table_row_wise_uses_one_host() -> None:
    ps = one(Table("t", 9, 4), table_row_wise(1), 8, rph=4)
    assert ps.ranks == (4, 5, 6, 7)
    assert spans(ps) == [(4, 0, 3, 0, 4), (5, 3, 2, 0, 4), (6, 5, 2, 0, 4), (7, 7, 2, 0, 4)]


def test_table_column_wise_uses_one_host() -> None:
    ps = one(Table("t", 3, 16), table_column_wise(0), 4, rph=2)
    assert spans(ps) == [(0, 0, 3, 0, 8), (1, 0, 3, 8, 8)]


def test_table_row_wise_unknown_host() -> None:
    with pytest.raises(
        PlanError, match="host 2 does not exist; world size 8 with 4 ranks per host"
    ):
        one(Table("t", 9, 4), table_row_wise(2), 8, rph=4)


def test_data_parallel_and_options_carried() -> None:
    opt = FusedOptimizerConfig(name="adam", lr=0.5)
    ps = one(Table("t", 3, 4), data_parallel(backend=Backend.RECOPT, optimizer=opt), 3)
    assert ps.ranks == (0, 1, 2) and ps.shards == ()
    assert ps.backend is Backend.RECOPT and ps.optimizer == opt


def test_empty_rank_list_rejected() -> None:
    with pytest.raises(PlanError, match="column_wise needs at least one rank"):
        one(Table("t", 3, 4), column_wise([]), 2)


def test_construct_rejects_missing_and_unknown_tables() -> None:
    tables = [Table("a", 4, 4), Table("b", 4, 4)]
    with pytest.raises(PlanError, match=r"table 'b' \(module 'm'\): no sharding requested"):
        construct_module_sharding_plan(tables, {"a": table_wise(0)}, 2, module_path="m")
    with pytest.raises(PlanError, match=r"requests for unknown tables \['c'\]"):
        construct_module_sharding_plan(
            tables, {"a": table_wise(0), "b": table_wise(0), "c": row_wise()}, 2
        )


def test_balanced_table_wise_plan_is_greedy_and_valid() -> None:
    tables = {"m": [Table(f"t{i}", 100 * (i + 1), 4) for i in range(6)], "": [Table("r", 50, 4)]}
    plan = balanced_table_wise_plan(tables, 3)
    validate_plan(plan, tables, 3)
    load = [0, 0, 0]
    for shardings in plan.plan.values():
        for ps in shardings.values():
            (s,) = ps.shards
            load[s.rank] += s.num_rows * s.num_cols
    # Sizes 2400, 2000, ..., 400 and 200, largest first onto the least loaded (lowest) rank:
    # r0 2400+400+200, r1 2000+800, r2 1600+1200.
    assert load == [3000, 2800, 2800]


# --------------------------------------------------------------------------------------------
# JSON


def rich_plan() -> ShardingPlan:
    tables = [Table("a", 10, 8), Table("b", 3, 12), Table("c", 4, 4)]
    opt = FusedOptimizerConfig(
        name="adafactor", lr=0.1 / 3, eps=None, betas=(0.8, 0.95), backend=Backend.FBGEMM
    )
    per = {
        "a": row_wise(optimizer=opt),
        "b": column_wise([1, 0, 1], backend=Backend.FBGEMM),
        "c": data_parallel(),
    }
    return ShardingPlan(
        {
            "sparse.ebc": construct_module_sharding_plan(tables, per, 2),
            "": {"z": one(Table("z", 5, 4), table_wise(1), 2)},
        }
    )


def test_json_round_trip_exact(tmp_path: object) -> None:
    plan = rich_plan()
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()
    opt = again["sparse.ebc"]["a"].optimizer
    assert opt is not None and opt.lr == 0.1 / 3 and opt.betas == (0.8, 0.95)
    assert opt.backend is Backend.FBGEMM and opt.eps is None
    doc = json.loads(plan.to_json())
    assert doc["plan"]["sparse.ebc"]["b"]["backend"] == "fbgemm"
    assert doc["plan"]["sparse.ebc"]["c"]["sharding_type"] == "data_parallel"


def test_save_load(tmp_path: pytest.TempPathFactory) -> None:
    plan = rich_plan()
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    assert ShardingPlan.load(path) == plan


def test_get_and_getitem() -> None:
    plan = rich_plan()
    assert plan.get("nope") is None
    assert plan[""]["z"].ranks == (1,)
    assert plan != ShardingPlan({})


def test_parameter_sharding_accepts_strings_and_lists() -> None:
    ps = ParameterSharding(
        sharding_type="table_wise",  # type: ignore[arg-type]
        ranks=[0],  # type: ignore[arg-type]
        shards=[ShardSpec(rank=0, row_offset=0, num_rows=1, col_offset=0, num_cols=1)],  # type: ignore[arg-type]
        backend="recopt",  # type: ignore[arg-type]
    )
    assert ps.sharding_type is ShardingType.TABLE_WISE and ps.backend is Backend.RECOPT
    assert ps.ranks == (0,) and isinstance(ps.shards, tuple)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: "not json", "not valid JSON"),
        (lambda d: {**d, "version": 9}, "version 1; got version 9"),
        (lambda d: {**d, "extra": 1}, r"unknown keys \['extra'\]"),
        (lambda d: {"version": 1, "plan": []}, "plan: expected a JSON object, got list"),
        (
            lambda d: _set(d, "sharding_type", "diagonal"),
            r"table 'z' \(module ''\): malformed.*diagonal",
        ),
        (lambda d: _set(d, "bogus", 1), r"table 'z' \(module ''\): unknown keys \['bogus'\]"),
        (lambda d: _drop(d, "ranks"), r"table 'z' \(module ''\): missing keys \['ranks'\]"),
        (lambda d: _set(d, "ranks", [1.5]), "must be integers, got 1.5"),
        (lambda d: _set(d, "shards", [[1, 0, 5, 0]]), "malformed sharding"),
        (
            lambda d: _set(d, "optimizer", {"name": "sgd", "momentum": 1}),
            r"unknown keys \['momentum'\]",
        ),
        (lambda d: _set(d, "optimizer", {"name": "lion"}), "malformed.*'lion' is unknown"),
    ],
)
def test_from_json_errors(mutate: object, message: str) -> None:
    doc = json.loads(ShardingPlan({"": {"z": one(Table("z", 5, 4), table_wise(1), 2)}}).to_json())
    bad = mutate(doc)  # type: ignore[operator]
    with pytest.raises(PlanError, match=message):
        ShardingPlan.from_json(bad if isinstance(bad, str) else json.dumps(bad))


def _set(doc: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    doc["plan"][""]["z"][key] = value
    return doc


def _drop(doc: dict[str, Any], key: str) -> dict[str, Any]:
    del doc["plan"][""]["z"][key]
    return doc


# --------------------------------------------------------------------------------------------
# validation: every error with its message

T = Table("t3", 100, 8)
WHERE = re.escape("table 't3' (module 'sparse.ebc'): ")


def shard(rank: int, r0: int, nr: int, c0: int = 0, nc: int = 8) -> ShardSpec:
    return ShardSpec(rank=rank, row_offset=r0, num_rows=nr, col_offset=c0, num_cols=nc)


def check(ps: ParameterSharding, world_size: int = 4, rph: int | None = None) -> None:
    validate_plan(ShardingPlan({"sparse.ebc": {"t3": ps}}), {"sparse.ebc": [T]}, world_size, rph)


def rw(
    *shards: ShardSpec, kind: ShardingType = ShardingType.ROW_WISE, **kw: object
) -> ParameterSharding:
    ranks = tuple(sorted({s.rank for s in shards}))
    return ParameterSharding(sharding_type=kind, ranks=ranks, shards=shards, **kw)  # type: ignore[arg-type]


def test_valid_hand_built_row_wise_passes() -> None:
    check(rw(shard(0, 0, 50), shard(1, 50, 50)))


@pytest.mark.parametrize(
    ("ps", "message"),
    [
        (rw(shard(0, 0, 90)), "shards cover rows 0..90 of 100; rows 90..100 have no shard"),
        (rw(shard(0, 0, 40), shard(1, 50, 50)), "rows 40..50 have no shard"),
        (rw(shard(0, 0, 60), shard(1, 50, 50)), "shards overlap on rows 50..60"),
        (
            rw(shard(0, 0, 50), shard(1, 50, 51)),
            r"shard rows 50..101, columns 0..8 on rank 1 is outside",
        ),
        (
            rw(shard(0, 0, 100), shard(1, 100, 0)),
            "empty shard rows 100..100, columns 0..8 on rank 1",
        ),
        (rw(shard(0, -1, 101)), "outside the table"),
        (rw(shard(7, 0, 100)), r"rank 7 does not exist; ranks are 0..3"),
        (
            ParameterSharding(
                sharding_type=ShardingType.ROW_WISE, ranks=(0, 1), shards=(shard(0, 0, 100),)
            ),
            r"ranks \[0, 1\] must equal the shards' ranks \[0\]",
        ),
        (
            ParameterSharding(sharding_type=ShardingType.ROW_WISE, ranks=(), shards=()),
            "row_wise sharding has no shards",
        ),
        (
            ParameterSharding(sharding_type=ShardingType.DATA_PARALLEL, ranks=(0, 1)),
            r"data_parallel must have no shards and ranks 0..3.*got ranks \[0, 1\]",
        ),
        (
            ParameterSharding(
                sharding_type=ShardingType.DATA_PARALLEL,
                ranks=(0, 1, 2, 3),
                shards=(shard(0, 0, 100),),
            ),
            "data_parallel must have no shards",
        ),
        (
            rw(shard(0, 0, 50), shard(1, 50, 50), kind=ShardingType.TABLE_WISE),
            "table_wise needs exactly one shard .* got 2",
        ),
        (
            rw(shard(0, 0, 100, 0, 4), kind=ShardingType.TABLE_WISE),
            r"table_wise shards span every column \(0..8\)",
        ),
        (rw(shard(0, 0, 100, 0, 4), shard(1, 0, 100, 4, 4)), "row_wise shards span every column"),
        (
            rw(shard(0, 0, 50, 0, 8), shard(1, 50, 50, 0, 8), kind=ShardingType.COLUMN_WISE),
            r"column_wise shards span every row \(0..100\); shard rows 0..50",
        ),
        (
            rw(shard(0, 0, 100, 0, 4), kind=ShardingType.COLUMN_WISE),
            "shards cover columns 0..4 of 8; columns 4..8 have no shard",
        ),
        (rw(shard(0, 0, 50), shard(0, 50, 50)), "row_wise puts at most one row range on a rank"),
        (
            rw(shard(1, 0, 50), shard(2, 50, 50), kind=ShardingType.TABLE_ROW_WISE),
            r"table_row_wise keeps a table inside one host, "
            r"but its ranks \[1, 2\] span hosts \[0, 1\]",
        ),
        (
            rw(shard(1, 0, 100, 0, 4), shard(2, 0, 100, 4, 4), kind=ShardingType.TABLE_COLUMN_WISE),
            "table_column_wise keeps a table inside one host.*use column_wise instead",
        ),
        (
            rw(
                shard(0, 0, 100, 0, 6),
                shard(1, 0, 100, 6, 2),
                kind=ShardingType.COLUMN_WISE,
                backend=Backend.FBGEMM,
            ),
            "shard width 6 is not a multiple of 4, which the fbgemm kernel requires",
        ),
    ],
)
def test_validation_errors(ps: ParameterSharding, message: str) -> None:
    with pytest.raises(PlanError, match=WHERE + ".*" + message):
        check(ps, world_size=4, rph=2)


def test_odd_widths_allowed_for_auto_and_recopt() -> None:
    for kernel in (Backend.AUTO, Backend.RECOPT):
        check(
            rw(
                shard(0, 0, 100, 0, 6),
                shard(1, 0, 100, 6, 2),
                kind=ShardingType.COLUMN_WISE,
                backend=kernel,
            )
        )


def test_data_parallel_fbgemm_needs_dim_multiple_of_four() -> None:
    table = Table("d", 4, 6)
    ps = ParameterSharding(
        sharding_type=ShardingType.DATA_PARALLEL, ranks=(0, 1), backend=Backend.FBGEMM
    )
    with pytest.raises(
        PlanError, match=r"table 'd' \(module ''\): shard width 6 is not a multiple of 4"
    ):
        validate_plan(ShardingPlan({"": {"d": ps}}), {"": [table]}, 2)


def test_validation_of_modules_and_tables() -> None:
    ps = one(T, table_wise(0), 2)
    tables = {"sparse.ebc": [T]}
    with pytest.raises(PlanError, match=r"plan names unknown modules \['other'\]"):
        validate_plan(ShardingPlan({"sparse.ebc": {"t3": ps}, "other": {}}), tables, 2)
    with pytest.raises(PlanError, match="module 'sparse.ebc': the plan has no entry for it"):
        validate_plan(ShardingPlan({}), tables, 2)
    with pytest.raises(PlanError, match=r"module 'sparse.ebc': plan names unknown tables \['t9'\]"):
        validate_plan(ShardingPlan({"sparse.ebc": {"t3": ps, "t9": ps}}), tables, 2)
    with pytest.raises(PlanError, match=WHERE + "not in the plan"):
        validate_plan(ShardingPlan({"sparse.ebc": {}}), tables, 2)
    with pytest.raises(PlanError, match=r"module 'sparse.ebc': duplicate table names \['t3'\]"):
        validate_plan(ShardingPlan({"sparse.ebc": {"t3": ps}}), {"sparse.ebc": [T, T]}, 2)


def test_world_size_and_ranks_per_host_must_be_positive() -> None:
    with pytest.raises(PlanError, match="world_size must be >= 1, got 0"):
        validate_plan(ShardingPlan({}), {}, 0)
    with pytest.raises(PlanError, match="ranks_per_host must be >= 1, got 0"):
        validate_plan(ShardingPlan({}), {}, 2, 0)


def test_plan_error_is_value_error() -> None:
    assert issubclass(PlanError, ValueError)
