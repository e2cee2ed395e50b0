"""`recopt-reshard` for id-mapped tables: every live id written on the row shard that owns it.

Under the target plan an id-mapped table's rows are cut into its row shards, and each live id
must sit on shard `route_shard(id, shards)`. Here a table's map buffers, weight and optimizer
states are read together (one table in memory at a time), cut into the plan's row shards, and
moved with `id_map_relocate.relocate_in_process`: the runtime relocation's own records,
free-row order and overflow rule, every rank of the target world in this process. The first
forward after loading the output then finds nothing to move.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from recopt.checkpoint.keys import MAP_KEY, table_of
from recopt.kernels.registry import OPTIMIZERS, StateShape
from recopt.modules.config import BaseEmbeddingConfig
from recopt.modules.id_map import CANDIDATE_BUFFERS, IdMap
from recopt.sharding.id_map_relocate import ShardRows, TableRelocation, relocate_in_process
from recopt.sharding.id_map_shards import MapShard, shard_map, table_map_shards
from recopt.sharding.plan import ShardingPlan

__all__ = ["IdMapTable", "id_map_tables", "map_chunks", "place_ids"]

_ROW_SHAPES = (StateShape.PER_ROW, StateShape.PER_ELEMENT)
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class IdMapTable:
    """One id-mapped table of a checkpoint that the target plan places.

    Attributes:
        module: the module path (the plan's key).
        config: the table's config (its ``id_map`` gives the policy and ttl).
        shards: the table's row shards under the target plan (`table_map_shards`).
        maps: map buffer name (``row_ids``, ``step``, ...) -> checkpoint key.
        weight: the weight's checkpoint key.
        states: optimizer state name (``exp_avg``, ``step``, ...) -> checkpoint key.
    """

    module: str
    config: BaseEmbeddingConfig
    shards: list[MapShard]
    maps: dict[str, str]
    weight: str
    states: dict[str, str]

    @property
    def keys(self) -> list[str]:
        """Every checkpoint key of the table, read and written together."""
        return [*self.maps.values(), self.weight, *self.states.values()]


def id_map_tables(
    shapes: Mapping[str, list[int]],
    plan: ShardingPlan | None,
    tables: Sequence[BaseEmbeddingConfig] | None,
    owners: Collection[tuple[str, str]],
) -> list[IdMapTable]:
    """The id-mapped tables of a checkpoint whose ids are placed for ``plan``.

    A table is id-mapped when the checkpoint holds its map (``model/<module>.id_maps.<table>.
    row_ids``). Without a plan, or for a table the plan does not place, nothing is placed:
    the rows stay at their global rows and the first forward after the load moves the ids.
    So too with a plan but no ``tables`` at all (a warning names the tables and the fix): the
    checkpoint the plan loads is as right, only its first forward moves the ids.

    Args:
        shapes: every checkpoint key -> its global shape.
        plan: the target plan.
        tables: the model's table configs, matched by name (every module's table of that
            name); given, each id-mapped table the plan places needs one with its ``id_map``.
        owners: the model's (module, table) pairs (`keys.model_tables`).

    Raises:
        ValueError: ``tables`` has no config for a placed id-mapped table, or one that does not
            match the checkpoint (naming the table, the field and the fix).
        PlanError: the plan shards an id-mapped table in a way that gives a row no one owner.
    """
    if plan is None:
        return []
    maps: dict[tuple[str, str], dict[str, str]] = {}
    for key in shapes:
        match = MAP_KEY.match(key)
        if match is not None:
            module, table = match.group("module") or "", match.group("table")
            maps.setdefault((module, table), {})[match.group("buffer")] = key
    placed = sorted(key for key in maps if (plan.get(key[0]) or {}).get(key[1]) is not None)
    if tables is None:
        if placed:
            logger.warning(
                "recopt-reshard: id-mapped tables %s keep their rows at their global rows (no "
                "table configs given); the first forward after the load moves each id to its "
                "owner shard. Pass --config MODEL.toml (the config recopt-plan reads) to write "
                "them there now",
                ", ".join(f"{m}.{t}" if m else t for m, t in placed),
            )
        return []
    configs = {t.name: t for t in tables}
    out = []
    for (module, name), buffers in sorted(maps.items()):
        sharding = (plan.get(module) or {}).get(name)
        if sharding is None:
            continue
        config = _config_of(module, name, configs)
        weight, states = _table_keys(shapes, module, name, owners)
        _check_shapes(module, config, buffers, weight, shapes)
        shards = table_map_shards(0, config, sharding)  # the plan's rule for an id-mapped table
        out.append(IdMapTable(module, config, shards, buffers, weight, states))
    return out


def _config_of(
    module: str, name: str, configs: Mapping[str, BaseEmbeddingConfig]
) -> BaseEmbeddingConfig:
    config = configs.get(name)
    where = f"table {name!r} (module {module!r})"
    if config is None or config.id_map is None:
        have = "no table of that name" if config is None else "that table without id_map"
        raise ValueError(
            f"{where} is id-mapped in the checkpoint and placed by the plan, but the table "
            f"configs give {have}; pass the model's tables (recopt-reshard --config MODEL.toml, "
            "the config recopt-plan reads) to write each id on its owner shard, or leave out "
            "--plan to keep rows at their global rows (the first forward then moves the ids)"
        )
    return config


def _table_keys(
    shapes: Mapping[str, list[int]], module: str, name: str, owners: Collection[tuple[str, str]]
) -> tuple[str, dict[str, str]]:
    """The weight's key and the optimizer states' keys (by state name) of one table."""
    weight = None
    states: dict[str, str] = {}
    for key in shapes:
        if table_of(key, owners) != (module, name):
            continue
        if key.startswith("model/"):
            weight = key
        else:
            states[key.rsplit("/", 1)[1].removeprefix(f"{name}.")] = key
    if weight is None:
        raise ValueError(
            f"table {name!r} (module {module!r}): the checkpoint holds its id map but no "
            "weight; it is damaged or not a recopt checkpoint of this model"
        )
    return weight, states


def _check_shapes(
    module: str,
    config: BaseEmbeddingConfig,
    maps: Mapping[str, str],
    weight: str,
    shapes: Mapping[str, list[int]],
) -> None:
    """The checkpoint's map and weight match the config (rows, width, candidates)."""
    assert config.id_map is not None
    rows, dim = config.num_embeddings, config.embedding_dim
    problems = []
    if shapes[weight] != [rows, dim]:
        problems.append(f"weight {shapes[weight]} (config: [{rows}, {dim}])")
    for buffer, key in maps.items():
        want = [] if buffer == "step" else [rows]
        if buffer in CANDIDATE_BUFFERS:
            want = [config.id_map.candidate_slots or rows]
        if shapes[key] != want:
            problems.append(f"{buffer} {shapes[key]} (config: {want})")
    expected = set(IdMap(config.id_map, 1, "meta").state_dict())
    if set(maps) != expected:
        problems.append(f"map buffers {sorted(maps)} (config: {sorted(expected)})")
    if problems:
        raise ValueError(
            f"table {config.name!r} (module {module!r}): the checkpoint does not match its "
            f"config: {'; '.join(problems)}; pass the config the checkpoint was trained with"
        )


def _optimizer_of(entry: IdMapTable, states: Mapping[str, torch.Tensor]) -> str:
    """The name of a fused optimizer whose states are these (names and shapes); optimizers
    with the same states (adam, lamb) move the same rows, so any of them will do."""
    rows, dim = entry.config.num_embeddings, entry.config.embedding_dim
    sizes = {StateShape.PER_ROW: [rows], StateShape.PER_ELEMENT: [rows, dim]}
    sizes[StateShape.PER_COLUMN] = [dim]
    found = {n: list(t.shape) for n, t in states.items() if t.dim() > 0}
    for spec in OPTIMIZERS.values():
        if found == {n: sizes[shape] for n, shape in spec.states}:
            return spec.name
    raise ValueError(
        f"table {entry.config.name!r} (module {entry.module!r}): optimizer states {found} "
        "are no fused optimizer's; the checkpoint is damaged or of another model"
    )


def place_ids(
    entry: IdMapTable, tensors: Mapping[str, torch.Tensor], world_size: int
) -> TableRelocation:
    """Move every live id (and candidate) of one table to its owner shard, in place.

    Args:
        entry: the table.
        tensors: its checkpoint key -> the whole tensor (``entry.keys``), written in place.
        world_size: the target world size.

    Returns:
        The table's counts summed over its shards (a warning names a shard that dropped ids).
    """
    config, shards = entry.config, entry.shards
    states = {name: tensors[key] for name, key in entry.states.items()}
    optimizer = _optimizer_of(entry, states)
    moving = {n for n, shape in OPTIMIZERS[optimizer].states if shape in _ROW_SHAPES}
    by_rank: dict[int, ShardRows] = {}
    maps: list[tuple[MapShard, IdMap]] = []
    for s in shards:
        idmap = shard_map(config, s, torch.device("cpu"))
        idmap.load_state_dict({n: _part(tensors[k], n, s) for n, k in entry.maps.items()})
        maps.append((s, idmap))
        by_rank[s.rank] = ShardRows(
            index=s.shard,
            idmap=idmap,
            weight=_part(tensors[entry.weight], "weight", s),
            states={n: _part(t, n, s) for n, t in states.items() if n in moving},
            optimizer=optimizer,
        )
    ranks = [s.rank for s in shards]
    reports = relocate_in_process(
        [[(config.name, ranks, by_rank.get(r))] for r in range(world_size)]
    )
    with torch.no_grad():
        for s, idmap in maps:
            for n, k in entry.maps.items():
                if n != "step":
                    _part(tensors[k], n, s).copy_(idmap.buffer(n))
    total = TableRelocation()
    for report in reports:
        for field in dataclasses.fields(total):
            value = getattr(report.tables[config.name], field.name)
            setattr(total, field.name, getattr(total, field.name) + value)
    return total


def _span(name: str, shard: MapShard) -> tuple[int, int] | None:
    """(offset, length) of shard ``shard``'s part of a table's tensor ``name`` (the weight, a
    state or a map buffer; candidate buffers: its candidate slots), None for ``step`` (whole)."""
    if name == "step":
        return None
    if name in CANDIDATE_BUFFERS:
        return shard.candidate_offset, shard.candidate_slots
    return shard.row_offset, shard.num_rows


def _part(tensor: torch.Tensor, name: str, shard: MapShard) -> torch.Tensor:
    """Shard ``shard``'s part of a table's tensor ``name``, a view (``step``: all of it)."""
    span = _span(name, shard)
    return tensor if span is None else tensor.narrow(0, *span)


def map_chunks(entry: IdMapTable, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The chunks a map buffer of ``entry`` is written in: its row shards' ranges (candidate
    buffers: the shards' candidate slots; ``step`` whole), or None for a key that is not a
    map buffer (the weight and states follow the plan's rectangles)."""
    buffer = next((n for n, k in entry.maps.items() if k == key), None)
    if buffer is None:
        return None
    if buffer == "step":
        return [((), ())]
    spans = [_span(buffer, s) for s in entry.shards]
    return [((span[0],), (span[1],)) for span in spans if span is not None]
