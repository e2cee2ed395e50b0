"""Owner-local id maps, the pure parts: which row shards keep a table's map (`map_shards`), the
candidate slots split in proportion to rows, and the refusal of layouts that cannot keep one
consistent map (column-split, data-parallel). No process group needed."""

from __future__ import annotations

from typing import Any

import pytest

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, IdMapConfig
from recopt.sharding import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recopt.sharding.id_map_shards import map_shards
from recopt.sharding.layout import ShardedLayout
from recopt.sharding.plan import PlanError

ADAGRAD = FusedOptimizerConfig(name="adagrad")


def _table(rows: int, id_map: IdMapConfig | None = None) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="t", num_embeddings=rows, embedding_dim=8, feature_names=("f",), id_map=id_map
    )


def _layout(table: EmbeddingBagConfig, request: Any, world: int) -> ShardedLayout:
    """The layout of ``table`` (plan made for its unmapped twin: plan validation refuses some
    layouts of id-mapped tables itself; here the module's own check is under test)."""
    plan = construct_module_sharding_plan([_table(table.num_embeddings)], {"t": request}, world)
    return ShardedLayout([table], plan, {"t": ADAGRAD}, world, 0)


@pytest.mark.parametrize(
    "request_, kind",
    [
        (column_wise([0, 1]), "column_wise"),
        (table_column_wise(0), "table_column_wise"),
        (data_parallel(), "data_parallel"),
    ],
)
def test_column_split_and_data_parallel_id_maps_are_refused(request_: Any, kind: str) -> None:
    table = _table(10, IdMapConfig())
    with pytest.raises(
        PlanError, match=rf"table 't': sharding type {kind} cannot hold an id-mapped"
    ):
        map_shards([table], _layout(table, request_, 2))


def test_row_shards_keep_their_rows_and_candidates_in_proportion() -> None:
    table = _table(10, IdMapConfig(admit_after=2, candidate_slots=7))
    shards = map_shards([table], _layout(table, row_wise(), 3))
    assert [(s.rank, s.row_offset, s.num_rows) for s in shards] == [(0, 0, 4), (1, 4, 3), (2, 7, 3)]
    # 7 slots over rows 4, 3, 3: floor(7 * 4 / 10) = 2, floor(7 * 7 / 10) = 4, then 7.
    assert [(s.candidate_offset, s.candidate_slots) for s in shards] == [(0, 2), (2, 2), (4, 3)]
    assert all(s.num_shards == 3 and s.shard == k for k, s in enumerate(shards))


def test_default_candidate_slots_follow_the_rows() -> None:
    table = _table(10, IdMapConfig(admit_after=2))
    shards = map_shards([table], _layout(table, table_row_wise(0), 2))
    assert [s.candidate_slots for s in shards] == [s.num_rows for s in shards] == [5, 5]
    no_admission = map_shards([_table(10, IdMapConfig())], _layout(table, table_wise(1), 2))
    assert [(s.rank, s.num_rows, s.candidate_slots) for s in no_admission] == [(1, 10, 0)]


def test_too_few_candidate_slots_for_the_shards_is_an_error() -> None:
    table = _table(10, IdMapConfig(admit_after=2, candidate_slots=2))
    with pytest.raises(ValueError, match="candidate_slots 2 split over its 3 row shards"):
        map_shards([table], _layout(table, row_wise(), 3))


def test_unmapped_tables_have_no_map_shards() -> None:
    table = _table(10)
    assert map_shards([table], _layout(table, column_wise([0, 1]), 2)) == []
