"""Where the owner-local id maps of a sharded collection live, and their state as ShardedTensors.

Each id-mapped table's row shards (table-wise: one; row-wise / table-row-wise: one per rank)
keep the map of their own rows: `map_shards` lists them, with each shard's share of the
table's candidate slots. `map_state` exposes a table's map buffers as row-sharded
ShardedTensors of the table's global shape (``row_ids`` ``[num_embeddings]``, each shard at
its ``row_offset`` like the weights), so a checkpoint reads "row r holds id row_ids[r]" in
every layout. Nothing here communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.modules.config import BaseEmbeddingConfig, EmbeddingBagConfig
from recopt.modules.id_map import CANDIDATE_BUFFERS, IdMap, IdMapConfig
from recopt.sharding.layout import ShardedLayout
from recopt.sharding.plan import ParameterSharding
from recopt.sharding.plan_validation import check_id_map_sharding
from recopt.sharding.state import Piece, make_sharded_tensor


@dataclass(frozen=True, slots=True)
class MapShard:
    """One row shard of an id-mapped table: the rows (and candidate slots) whose map it keeps.

    ``candidate_slots`` is 0 for a table without admission (``admit_after`` unset or 1).
    """

    table: int
    name: str
    shard: int
    num_shards: int
    rank: int
    row_offset: int
    num_rows: int
    candidate_offset: int
    candidate_slots: int


def _candidate_split(table: BaseEmbeddingConfig, rows: Sequence[int]) -> list[int]:
    """The table's candidate slots split over its shards in proportion to their rows."""
    assert table.id_map is not None
    if (table.id_map.admit_after or 1) <= 1:
        return [0] * len(rows)
    total = table.id_map.candidate_slots or table.num_embeddings
    ends, acc = [], 0
    for n in rows:
        acc += n
        ends.append(total * acc // table.num_embeddings)
    split = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    if min(split) < 1:
        raise ValueError(
            f"table {table.name!r}: id_map.candidate_slots {total} split over its "
            f"{len(rows)} row shards in proportion to their rows {list(rows)} leaves a shard "
            f"without a slot; set candidate_slots to at least {table.num_embeddings} (or unset)"
        )
    return split


def map_shards(tables: Sequence[EmbeddingBagConfig], layout: ShardedLayout) -> list[MapShard]:
    """Every row shard of every id-mapped table, in table then shard order.

    Raises:
        PlanError: an id-mapped table sharded column-wise or data-parallel (plan validation's
            rule, `check_id_map_sharding`, checked again on the layout the maps are built on).
        ValueError: a ``candidate_slots`` too small to give every shard a slot.
    """
    out: list[MapShard] = []
    for t, table in enumerate(tables):
        if table.id_map is not None:
            out += table_map_shards(t, table, layout.shardings[t])
    return out


def table_map_shards(
    t: int, table: BaseEmbeddingConfig, sharding: ParameterSharding
) -> list[MapShard]:
    """The row shards of id-mapped ``table`` (index ``t``) under ``sharding``, in the plan's
    shard order (the order `route_shard` numbers them in); `map_shards` of one table, also
    for a plan no module is built for (`recopt-reshard`).

    Raises:
        PlanError, ValueError: as `map_shards`.
    """
    check_id_map_sharding(sharding, table, f"table {table.name!r}")
    shards = sharding.shards
    assert len({s.rank for s in shards}) == len(shards), "a row split holds 1 shard a rank"
    candidates = _candidate_split(table, [s.num_rows for s in shards])
    out, offset = [], 0
    for k, (s, slots) in enumerate(zip(shards, candidates, strict=True)):
        assert s.col_offset == 0 and s.num_cols == table.embedding_dim
        out.append(
            MapShard(t, table.name, k, len(shards), s.rank, s.row_offset, s.num_rows, offset, slots)
        )
        offset += slots
    return out


def shard_map(table: BaseEmbeddingConfig, shard: MapShard, device: torch.device) -> IdMap:
    """The map of ``shard``: the table's `IdMapConfig` over the shard's rows and slots."""
    assert table.id_map is not None
    config = table.id_map
    if config.candidate_slots is not None:
        config = dataclasses.replace(config, candidate_slots=shard.candidate_slots)
    return IdMap(config, shard.num_rows, device)


def step_counter(device: torch.device) -> IdMap:
    """A one-row map stepped with no ids: a table's ``step`` on a rank without its shard.

    A map (not a bare tensor) so that fault tolerance's guard, which undoes map steps, also
    puts this counter back on a dropped step.
    """
    return IdMap(IdMapConfig(), 1, device)


def map_state(
    table: EmbeddingBagConfig,
    shards: Sequence[MapShard],
    local: Mapping[str, torch.Tensor] | None,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, ShardedTensor]:
    """A table's map buffers (all but ``step``) as ShardedTensors of the global shape.

    Args:
        table: the id-mapped table.
        shards: its `MapShard`s.
        local: this rank's shard map's buffers by name (None: it holds no shard of the
            table).
        rank: this rank in ``group``.
        group: the collection's process group.
        device: where the buffers live.
    """
    assert table.id_map is not None
    proto = IdMap(table.id_map, 1, "meta").state_dict()
    out: dict[str, ShardedTensor] = {}
    for name, value in proto.items():
        if name == "step":
            continue
        candidate = name in CANDIDATE_BUFFERS
        pieces: list[Piece] = []
        for s in shards:
            offset = s.candidate_offset if candidate else s.row_offset
            size = s.candidate_slots if candidate else s.num_rows
            mine = local[name] if local is not None and s.rank == rank else None
            pieces.append(([offset], [size], s.rank, mine))
        total = sum(s.candidate_slots if candidate else s.num_rows for s in shards)
        out[name] = make_sharded_tensor(pieces, [total], rank, group, device, value.dtype)
    return out
