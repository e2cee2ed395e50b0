"""Sharding types are specs: every fact about a type is in its `ShardingSpec`.

Both plan generators (hand-written requests and the planner's enumerator) cut a table with the
spec's one function, and a type without a spec is an error wherever it is used (never the
old catch-all that treated an unknown type as column-wise). Every test here takes its types from
the registry, so a new type is one spec entry plus the expected traits below.
"""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

import recopt
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import (
    SHARDING_SPECS,
    ParameterSharding,
    PlanError,
    ShardingPlan,
    ShardingRequest,
    ShardingSpec,
    ShardingType,
    row_wise,
    sharding_spec,
    table_wise,
    validate_plan,
)
from recopt.sharding.layout import resolve_optimizer
from recopt.sharding.planner.constraints import ParameterConstraints
from recopt.sharding.planner.enumerator import enumerate_options, table_workload
from recopt.sharding.planner.perf import shard_cost
from recopt.sharding.planner.topology import Topology

# The traits each type must have, written out by hand as the reference:
# (splits_rows, splits_columns, host_local, replicated, whole_table, one_shard).
EXPECTED_TRAITS = {
    "data_parallel": (False, False, False, True, True, False),
    "table_wise": (False, False, False, False, True, True),
    "row_wise": (True, False, False, False, False, False),
    "column_wise": (False, True, False, False, False, False),
    "table_row_wise": (True, False, True, False, False, False),
    "table_column_wise": (False, True, True, False, False, False),
}
WORLD, RANKS_PER_HOST = 4, 2
TABLE = EmbeddingBagConfig(name="t", num_embeddings=13, embedding_dim=16, feature_names=["f"])
ADAGRAD = FusedOptimizerConfig(name="adagrad")


def test_every_type_has_a_spec_with_its_traits() -> None:
    assert set(SHARDING_SPECS) == set(ShardingType)
    assert set(EXPECTED_TRAITS) == {t.value for t in SHARDING_SPECS}
    for kind, spec in SHARDING_SPECS.items():
        assert spec.sharding_type is kind
        traits = (
            spec.splits_rows,
            spec.splits_columns,
            spec.host_local,
            spec.replicated,
            spec.whole_table,
            spec.one_shard,
        )
        assert traits == EXPECTED_TRAITS[kind.value], kind
        # The enum's traits are the spec's.
        assert (kind.splits_rows, kind.splits_columns, kind.host_local) == traits[:3]
        assert (kind.replicated, kind.whole_table) == traits[3:5]


def _request(spec: ShardingSpec) -> ShardingRequest:
    return ShardingRequest(
        sharding_type=spec.sharding_type,
        ranks=(1,) if spec.one_shard else None,
        host=1 if spec.host_local else None,
    )


@pytest.mark.parametrize("kind", list(SHARDING_SPECS), ids=str)
def test_both_generators_cut_a_table_alike(kind: ShardingType) -> None:
    spec = SHARDING_SPECS[kind]
    by_hand = _request(spec).resolve(TABLE, WORLD, RANKS_PER_HOST)
    topology = Topology(world_size=WORLD, ranks_per_host=RANKS_PER_HOST)
    constraints = ParameterConstraints(sharding_types=(kind,))
    workload = table_workload(TABLE, constraints, 8, ADAGRAD)
    options = enumerate_options("", TABLE, constraints, workload, topology)
    hand_sizes = [(s.num_rows, s.num_cols) for s in by_hand.shards]
    same = [o for o in options if spec.replicated or o.shard_sizes == hand_sizes]
    assert same, (hand_sizes, [o.shard_sizes for o in options])
    # The planner's option, put on the hand plan's ranks, is the hand plan.
    ranks = [s.rank for s in by_hand.shards] or [0]
    assert same[0].to_parameter_sharding(ranks, WORLD) == by_hand
    for option in options:  # every layout the enumerator offers is a valid plan
        # Host 1 (ranks 2, 3) when the partitioner chooses; columns may share a rank.
        n = len(option.shard_sizes)
        host_ranks = [RANKS_PER_HOST + i % RANKS_PER_HOST for i in range(n)]
        ps = option.to_parameter_sharding(option.fixed_ranks or host_ranks, WORLD)
        validate_plan(ShardingPlan({"": {"t": ps}}), {"": [TABLE]}, WORLD, RANKS_PER_HOST)


@pytest.mark.parametrize("kind", list(SHARDING_SPECS), ids=str)
def test_cut_tiles_the_table(kind: ShardingType) -> None:
    spec = SHARDING_SPECS[kind]
    for parts in (1, 2, 3, 4):
        sizes = spec.cut(13, 12, parts, "t")
        shards = spec.place(sizes, list(range(parts)))
        assert 1 <= len(shards) <= parts
        if spec.splits_columns:
            assert [s.col_offset for s in shards] == [
                sum(c for _, c in sizes[:i]) for i in range(len(sizes))
            ]
            assert sum(c for _, c in sizes) == 12 and all(r == 13 for r, _ in sizes)
        else:
            assert sum(r for r, _ in sizes) == 13 and all(c == 12 for _, c in sizes)
        if spec.whole_table:
            assert sizes == [(13, 12)]


def test_a_type_without_a_spec_is_an_error_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    kind = ShardingType.COLUMN_WISE
    monkeypatch.delitem(SHARDING_SPECS, kind)

    def refused(call: object) -> None:
        assert callable(call)
        with pytest.raises(PlanError, match="'column_wise' has no ShardingSpec; known types"):
            call()

    refused(lambda: ParameterSharding(sharding_type=kind, ranks=(0,)))
    refused(lambda: ShardingRequest(sharding_type=kind).resolve(TABLE, WORLD))
    refused(lambda: kind.splits_columns)
    plan_json = (
        '{"version": 1, "plan": {"": {"t": {"sharding_type": "column_wise", "ranks": [0], '
        '"shards": [], "backend": "auto", "optimizer": null}}}}'
    )
    refused(lambda: ShardingPlan.from_json(plan_json))
    topology = Topology(world_size=WORLD)
    constraints = ParameterConstraints(sharding_types=(kind,))
    workload = table_workload(TABLE, constraints, 8, ADAGRAD)
    refused(lambda: enumerate_options("", TABLE, constraints, workload, topology))
    refused(lambda: shard_cost(kind, 13, 8, 13, workload, topology, 2))


def test_unknown_type_name_lists_the_known_ones() -> None:
    with pytest.raises(PlanError, match=r"'diagonal' has no ShardingSpec; known types: \["):
        sharding_spec("diagonal")
    with pytest.raises(PlanError, match="diagonal"):
        ParameterSharding(sharding_type="diagonal", ranks=(0,))  # type: ignore[arg-type]


def test_a_spec_splits_one_axis_and_a_replica_splits_none() -> None:
    cut = SHARDING_SPECS[ShardingType.ROW_WISE].cut
    with pytest.raises(ValueError, match="rows or columns, not both"):
        ShardingSpec(
            sharding_type=ShardingType.ROW_WISE, splits_rows=True, splits_columns=True, cut=cut
        )
    with pytest.raises(ValueError, match="replicated type does not split"):
        ShardingSpec(
            sharding_type=ShardingType.ROW_WISE, splits_rows=True, replicated=True, cut=cut
        )


def test_the_library_tests_traits_not_type_names() -> None:
    """No ``kind is ShardingType.X`` / ``kind in (ShardingType.X, ...)`` outside the specs: a
    branch on a type's name is a place a new type would silently miss."""
    library = pathlib.Path(recopt.__file__).parent
    offenders = []
    for path in sorted(library.rglob("*.py")):
        if path.name == "sharding_types.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            named = [
                n
                for o in operands
                for n in ast.walk(o)
                if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "ShardingType"
            ]
            if named:
                offenders.append(f"{path.relative_to(library)}:{node.lineno}")
    assert not offenders, offenders


def test_a_plan_names_the_backend_backend_and_old_plan_files_still_load() -> None:
    ps = row_wise(backend=Backend.RECOPT).resolve(TABLE, 2)
    plan = ShardingPlan({"": {"t": ps}})
    doc = json.loads(plan.to_json())
    assert (
        doc["plan"][""]["t"]["backend"] == "recopt" and "compute_kernel" not in doc["plan"][""]["t"]
    )
    # A plan file written before the rename calls the field compute_kernel.
    old = doc["plan"][""]["t"]
    old["compute_kernel"] = old.pop("backend")
    assert ShardingPlan.from_json(json.dumps(doc)).plan == plan.plan


def test_a_plan_backend_contradicting_the_optimizers_is_an_error() -> None:
    ps = table_wise(0, backend=Backend.RECOPT).resolve(TABLE, 1)
    for agreeing in (Backend.AUTO, Backend.RECOPT):
        optimizer = FusedOptimizerConfig(name="adagrad", backend=agreeing)
        assert resolve_optimizer(TABLE, ps, optimizer, "").backend is Backend.RECOPT
    fbgemm = FusedOptimizerConfig(name="adagrad", backend=Backend.FBGEMM)
    with pytest.raises(PlanError, match="backend 'recopt' contradicts the optimizer's backend"):
        resolve_optimizer(TABLE, ps, fbgemm, "")
