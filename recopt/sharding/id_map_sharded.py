"""Id-mapped tables in ShardedEmbeddingBagCollection: each row shard keeps the map of its rows.

Every id of an id-mapped table belongs to one row shard (`route_shard`, a hash of the raw id);
the rank holding that shard keeps the shard's map (`id_map_shards`). A forward sends each
rank's raw ids to their owners and gets global rows back (`id_map_exchange`: a count
exchange, then ids there and rows back); each owner steps its shard map once with the ids of
every source (source order). When the batch's forward takes the distribution (`take`), the
owner re-initialises the fresh rows of its shard (the hashed init) and zeroes their optimizer
state, the maps' observers told first (fault tolerance's guard): at once, or, for a batch a
pipeline distributed ahead, after the previous batch's update (its step pending until then:
`recopt.modules.id_map_ahead`). The ordinary sharded path then routes the rows by range, to
the same owner. Statistics come back with the rows, so `stats()` is global and equal on every
rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recopt.kernels.contract import Kernel
from recopt.modules.config import EmbeddingBagConfig
from recopt.modules.id_map import Remapped, RemapStats
from recopt.modules.id_map_ahead import AheadRemap
from recopt.modules.id_map_batch import MappedBatch, apply_rows, table_ids
from recopt.modules.id_map_lookup import IdMaps, refuse_init_fn, step_with_peers, unmapped_check
from recopt.modules.id_map_native import remap_tables
from recopt.modules.id_map_results import results_to, to_device
from recopt.modules.id_map_rows import FreshTable, reset_fresh_tables
from recopt.modules.inputs import FeatureLayout, PendingCheck
from recopt.modules.variable_batch import regular_batch
from recopt.sharding.bucketizer import Bucketizer
from recopt.sharding.id_map_exchange import STAT_FIELDS, IdExchange, ReceivedIds
from recopt.sharding.id_map_relocate import ShardRows, relocate
from recopt.sharding.id_map_shards import MapShard, map_shards, map_state, shard_map, step_counter
from recopt.sharding.input_dist import start_count_exchange
from recopt.sharding.input_stage import DistributedInput
from recopt.sharding.layout import ShardedLayout
from recopt.sharding.state import _copy_overlaps, quiet_sharded_tensor
from recopt.sparse import KeyedJaggedTensor

_STATE_PREFIX = "id_maps."


@dataclass(slots=True)
class ShardStep:
    """What a training step of this rank's shard maps leaves for the batch's forward: the
    fresh rows to reset, every shard's stats, and its pending record when started ahead."""

    resets: list[FreshTable]
    stats: torch.Tensor | None
    ahead: AheadRemap | None


class ShardedIdMaps:
    """The owner-local id maps of a sharded collection and their exchange.

    ``maps`` holds, per id-mapped table, this rank's shard map, or a one-row map stepped with
    no ids where the rank holds no shard of the table (its ``step``: the table's step counter
    is kept on every rank).

    Args:
        tables: the collection's tables.
        layout: the sharded layout (which shards this rank's kernels hold).
        kernels: this rank's kernels, model-parallel groups first, then data-parallel.
        group: the collection's process group.
        device: where the maps live.
        timeout: limit of each collective of the exchange.

    Raises:
        ValueError: an id-mapped table with ``init_fn``, sharded column-wise or
            data-parallel (see `map_shards`).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        layout: ShardedLayout,
        kernels: Sequence[Kernel],
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: datetime.timedelta,
    ) -> None:
        refuse_init_fn(tables, "on every rank", "do not shard")
        self.tables = list(tables)
        self._rank = dist.get_rank(group)
        self._pg = group
        self._device = device
        self._timeout = timeout
        self._shards = map_shards(tables, layout)
        self.names = [t.name for t in tables if t.id_map is not None]
        self._exchange = IdExchange(
            self._shards, self.names, dist.get_world_size(group), self._rank, group, timeout, device
        )
        own = {s.name: s for s in self._exchange.mine}
        self.maps = IdMaps([], device)  # on the host for CUDA tables (`map_device`)
        home = self.maps.home
        for table in self.tables:
            if table.id_map is not None:
                shard = own.get(table.name)
                self.maps.put(
                    table.name,
                    step_counter(home) if shard is None else shard_map(table, shard, home),
                )
        # Where each own shard's weight and state are: (kernel, its table index, optimizer).
        groups = [*layout.mp_groups, *layout.dp_groups]
        self._where: dict[tuple[int, int], tuple[Kernel, int, str]] = {}
        for group_layout, kernel in zip(groups, kernels, strict=True):
            for i, tk in enumerate(group_layout.tables):
                self._where[tk] = (kernel, i, group_layout.optimizer.name)
        # Where each own shard's rows start in the table (``mine`` order), on the maps' side.
        self._row_offsets = torch.tensor(
            [s.row_offset for s in self._exchange.mine], dtype=torch.int64, device=home
        )
        # Each own shard's weight and optimizer state views, made at its first fresh rows.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._stats = {name: RemapStats() for name in self.names}
        self._unread_stats: torch.Tensor | None = None  # the last step's, read when asked for
        self.relocate_pending = False
        self._ahead: AheadRemap | None = None  # the step being started ahead, if it is
        self._step: ShardStep | None = None  # the step just taken, for its DistributedInput

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table, the last training step's statistics over all its shards."""
        if self._unread_stats is not None:
            self._record_stats(self._unread_stats)
            self._unread_stats = None
        return {name: self._stats[name].as_dict() for name in self.names}

    def prepare(
        self,
        features: KeyedJaggedTensor | None,
        layout: FeatureLayout,
        is_weighted: bool,
        training: bool,
    ) -> tuple[MappedBatch | None, KeyedJaggedTensor | None, PendingCheck | None]:
        """`FeatureLayout.prepare_deferred` with the mapped ids rewritten to rows first.

        Every rank calls it once per forward (the id exchange is a collective); a rank whose
        input already failed passes ``features=None`` and gets Nones back.

        Raises:
            ValueError: as `FeatureLayout.select`.
        """
        selected = None if features is None else layout.select(features, is_weighted)
        mapped = self.remap(selected, layout, training)
        if mapped is None:
            return None, None, None
        prepared, check = layout.prepare_deferred(mapped.features, is_weighted, selected=True)
        return mapped, prepared, check

    def start_distribution(
        self,
        features: KeyedJaggedTensor,
        layout: FeatureLayout,
        is_weighted: bool,
        bucketizer: Bucketizer,
        training: bool,
        ahead: bool = False,
    ) -> DistributedInput:
        """`input_stage.start_distribution` with the mapped ids rewritten to rows first.

        After a load, the first call moves the loaded ids to their owner shards first
        (`_relocate_if_pending`). The step's fresh rows are reset when the forward takes the
        result (`take`). ``ahead``: a pipeline starts a training batch before the previous
        batch's forward; its map step is kept pending (`IdMaps.ahead`) until then. Otherwise
        the pending ahead steps are undone first (this batch comes before them).

        Raises:
            ValueError: ``ahead`` while fault tolerance steps the maps (observers or peers).
        """
        self._relocate_if_pending()
        if ahead and training and not self.maps.can_step_ahead():
            raise ValueError(
                f"id-mapped tables {self.names} under fault tolerance are remapped in their "
                "own forward: train them without TrainPipelineSparseDist (the plain loop)"
            )
        if not (ahead and training):
            self.maps.rewind_ahead()
        prepared: KeyedJaggedTensor | None = None
        check: PendingCheck | None = None
        index_F_B: torch.Tensor | None = None
        error: ValueError | None = None
        mapped: MappedBatch | None = None
        self._ahead = AheadRemap(features, self.maps.ahead.generation) if ahead else None
        try:
            regular, index_F_B = regular_batch(features, layout.feature_names)
            mapped, prepared, check = self.prepare(regular, layout, is_weighted, training)
        except ValueError as e:
            error = e
            if mapped is None and prepared is None:  # the other ranks' id exchange needs us
                self.prepare(None, layout, is_weighted, training)
        counts = start_count_exchange(
            prepared, error, bucketizer, is_weighted, self._pg, self._rank, check
        )
        started = DistributedInput(features, prepared, index_F_B, counts)
        started.mapped = mapped
        started.map_step, self._step = self._step, None
        return started

    def take(self, started: DistributedInput) -> bool:
        """The forward takes ``started``: its step's fresh rows are reset (the observers told
        first) and its stats become `stats()`'s. False: the step was undone since it started
        ahead (the forward distributes the batch again)."""
        step: ShardStep | None = started.map_step
        if step is None:  # evaluation, or a rejected batch: no map moved
            return True
        if step.ahead is not None and self.maps.ahead.take(step.ahead) is None:
            return False
        started.map_step = None  # taken once (a retried step does not reset again)
        reset_fresh_tables(self.maps, step.resets)
        self._unread_stats = step.stats
        return True

    def stale(self, started: DistributedInput) -> bool:
        """Whether ``started``'s map step, taken ahead, was undone since."""
        step: ShardStep | None = started.map_step
        return step is not None and step.ahead is not None and self.maps.ahead.stale(step.ahead)

    def remap(
        self, features: KeyedJaggedTensor | None, layout: FeatureLayout, training: bool
    ) -> MappedBatch | None:
        """This rank's selected ``features`` with mapped ids as rows (None: this rank's input
        already failed; it still joins the exchange). A collective, in training and eval.

        When any rank's input is bad (None, a bad id of an unmapped table, a NaN weight), no
        map moves and the mapped ids become row 0, so the input check that follows names the
        real culprit on every rank.
        """
        ids: dict[str, torch.Tensor] = {}
        bad = features is None
        if features is not None:
            check = unmapped_check(features, layout, self.names).bad
            bad = check is not None and bool(check)
            ids = table_ids(features, layout, self.names)
        routed = None if bad else self._exchange.route(ids)
        received = self._exchange.send_ids(routed, bad)
        if received is None:  # some rank's input is bad
            if training and self.maps.peers is not None:  # the other replica groups wait
                self.maps.peers.gather({}, True)  # for this one; every group drops the step
            if features is None:
                return None
            zeros = {
                n: Remapped(torch.zeros_like(ids[n]), ids[n][:0], ids[n][:0]) for n in self.names
            }
            return apply_rows(features, layout, zeros)
        assert features is not None
        rows_R, stats = self._step_shards(received, training)
        rows_M, every = self._exchange.send_rows(received, rows_R, stats)
        if self._step is not None:  # read on the host only when stats() is called
            self._step.stats = every
        sizes = [ids[n].numel() for n in self.names]
        rows = rows_M.to(features.values().device).split(sizes)
        empty = rows_M[:0]
        results = {n: Remapped(r, empty, empty) for n, r in zip(self.names, rows, strict=True)}
        return apply_rows(features, layout, results)

    def _step_shards(
        self, received: ReceivedIds, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Remap the received ids with this rank's shard maps (training: one step of every
        map, counters included, all in one native call where it can); their global rows, and
        in training the shards' statistics ``[own shards, len(STAT_FIELDS)]``.

        Maps kept on the host (a CUDA collection's) get the ids in one copy and send the
        rows back in one, with the fresh rows the forward resets."""
        mine = self._exchange.mine
        ids_R = received.ids_R.to(self.maps.home)
        ids = dict(zip([s.name for s in mine], ids_R.split(received.column_sizes), strict=True))
        if training:
            # the step counters of the tables held elsewhere step too (with no ids)
            ids.update({name: ids_R[:0] for name in self.names if name not in ids})
            results = self._step_maps(ids)
            if self._ahead is not None:
                for name, result in results.items():
                    assert result.undo is not None
                    self._ahead.undo[name] = result.undo
        else:
            maps = {s.name: self.maps.table_map(s.name) for s in mine}
            results = remap_tables(maps, ids, False)
        device = received.ids_R.device
        local_R = _cat([results[s.name].rows_M for s in mine], ids_R)
        # (on the maps' side: a GPU when maps stay there, without the native remap)
        sizes = to_device(torch.tensor(received.column_sizes, dtype=torch.int64), ids_R.device)
        offset_R = self._row_offsets.repeat_interleave(sizes, output_size=local_R.numel())
        rows_R = to_device(torch.where(local_R >= 0, local_R + offset_R, local_R), device)
        if not training:
            return rows_R, None
        fresh = {s.name: results[s.name] for s in mine if results[s.name].fresh_rows.numel()}
        fresh = results_to(fresh, self._device)  # the rows to reset, where the tables are
        resets = [self._fresh_table(s, fresh[s.name]) for s in mine if s.name in fresh]
        stats = [_shard_stats(s, results[s.name].stats) for s in mine]
        self._step = ShardStep(resets, None, self._ahead)  # reset when the forward takes it
        if self._ahead is not None:
            self.maps.ahead.add(self._ahead)
        shape = (len(stats), len(STAT_FIELDS))
        table = torch.tensor(stats, dtype=torch.int64).reshape(shape)
        return rows_R, to_device(table, device)  # (a plain .to() would wait for the GPU)

    def _step_maps(self, ids: dict[str, torch.Tensor]) -> dict[str, Remapped]:
        """One training step of every map of this rank (``ids``: each one's received ids).

        Under replica sync (``maps.peers``: fault tolerance's replica groups) each shard map
        steps with the ids the same shard received in every group, in group order, and keeps
        this group's rows (`step_with_peers`): the shard's map, rows and fresh rows are then
        the same in every group. A failed gather (the step will be dropped) steps the maps with
        this group's ids alone; the guard's rollback undoes it.
        """
        peers = self.maps.peers
        gathered = None if peers is None else peers.gather(ids, False)
        if gathered is not None:
            return step_with_peers(self.maps, *gathered)
        return self.maps.step_many(ids, record_undo=self._ahead is not None)

    def _fresh_table(self, shard: MapShard, result: Remapped) -> FreshTable:
        """The shard's fresh rows to re-initialise (hashed init), with its weight and optimizer
        state (their zeroing)."""
        key = (shard.table, shard.shard)
        if key not in self._views:  # the kernel's views, made once (fbgemm's: ~35 us a call)
            kernel, i, _ = self._where[key]
            self._views[key] = (
                kernel.split_embedding_weights()[i],
                kernel.split_optimizer_states()[i],
            )
        weight, states = self._views[key]
        return FreshTable(self.tables[shard.table], self._where[key][2], weight, states, result)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the collection) makes its own views of its kernels."""
        return {**self.__dict__, "_views": {}}

    def _record_stats(self, every: torch.Tensor) -> None:
        """Sum every shard's statistics (``[C, len(STAT_FIELDS)]``) into each table's."""
        totals = {name: RemapStats() for name in self.names}
        live = dict.fromkeys(self.names, 0)
        for shard, values in zip(self._exchange.columns, every.tolist(), strict=True):
            got = dict(zip(STAT_FIELDS, values, strict=True))
            total = totals[shard.name]
            total.step = got["step"]
            live[shard.name] += got["occupied"]
            for field in STAT_FIELDS[2:]:
                setattr(total, field, getattr(total, field) + got[field])
        for name, total in totals.items():
            total.occupancy = live[name] / self.tables[self._index(name)].num_embeddings
        self._stats = totals

    def _index(self, name: str) -> int:
        return next(t for t, table in enumerate(self.tables) if table.name == name)

    def _relocate_if_pending(self) -> None:
        """After a load, move every live id to the row shard that owns it (a collective).

        A checkpoint of another plan or world size, or an unsharded state, leaves ids on
        shards that do not own them (rows are global row numbers); `relocate` moves each with
        its counters, weight row and per-row / per-element optimizer state, which by now are
        all loaded (the first forward after `load`). Ids an owner has no room for are
        dropped, counted and warned about there.
        """
        if not self.relocate_pending:
            return
        own = {s.name: s for s in self._exchange.mine}
        entries: list[tuple[str, list[int], ShardRows | None]] = []
        for name in self.names:
            ranks = [s.rank for s in self._shards if s.name == name]
            shard = own.get(name)
            rows = None
            if shard is not None:
                kernel, i, optimizer = self._where[(shard.table, shard.shard)]
                rows = ShardRows(
                    index=shard.shard,
                    idmap=self.maps.table_map(name),
                    weight=kernel.split_embedding_weights()[i],
                    states=kernel.split_optimizer_states()[i],
                    optimizer=optimizer,
                )
            entries.append((name, ranks, rows))
        relocate(entries, self._pg, self._timeout)
        self.relocate_pending = False

    def _states(self, name: str, committed: bool) -> dict[str, Any]:
        """Table ``name``'s map state (``committed``: as before the pending ahead steps, on
        copies; else the live buffers, which a load writes into)."""
        t = self._index(name)
        shards = [s for s in self._shards if s.name == name]
        own = any(s.rank == self._rank for s in shards)
        buffers = dict(self.maps.table_map(name).named_buffers())
        if committed:
            buffers = self.maps.ahead.committed(name, buffers)
        local = buffers if own else None
        states: dict[str, Any] = dict(
            map_state(self.tables[t], shards, local, self._rank, self._pg, self.maps.home)
        )
        states["step"] = buffers["step"]
        return states

    def save(self, destination: dict[str, Any], prefix: str) -> None:
        """Write the maps' buffers under ``<prefix>id_maps.<table>.``: row-sharded
        ShardedTensors of the table's global shape, ``step`` a plain (replicated) tensor."""
        for name in self.names:
            for key, value in self._states(name, committed=True).items():
                destination[f"{prefix}{_STATE_PREFIX}{name}.{key}"] = value

    @quiet_sharded_tensor()
    def load(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        missing_keys: list[str],
    ) -> None:
        """Copy each shard's rows of the maps' buffers from ``state_dict`` (full tensors or
        ShardedTensors of any plan); missing ones are reported.

        Raises:
            ValueError: a buffer's global shape differs from the table's, naming the key.
        """
        self.maps.ahead.drop()  # the loaded maps replace the pending ahead steps
        for name in self.names:
            for key, current in self._states(name, committed=False).items():
                full = f"{prefix}{_STATE_PREFIX}{name}.{key}"
                if full not in state_dict:
                    missing_keys.append(full)
                    continue
                value = state_dict[full]
                shape = tuple(value.size() if hasattr(value, "local_shards") else value.shape)
                if shape != tuple(current.size()):
                    raise ValueError(
                        f"{full}: shape {shape} in the state_dict does not match the map's "
                        f"{tuple(current.size())} (table {name!r}); load a state of the same tables"
                    )
                with torch.no_grad():
                    if key == "step":
                        current.copy_(value)
                    else:
                        for shard in current.local_shards():
                            _copy_overlaps(shard, value)
            self.maps.table_map(name).buffers_changed()
        self.relocate_pending = True

    @staticmethod
    def owns(key: str) -> bool:
        """Whether a state key (without the module prefix) is one of the maps'."""
        return key.startswith(_STATE_PREFIX)


def _shard_stats(shard: MapShard, stats: RemapStats) -> list[int]:
    """One shard's `STAT_FIELDS` after a training step (its live rows, not a ratio)."""
    occupied = round(stats.occupancy * shard.num_rows)
    return [
        stats.step,
        occupied,
        stats.new_ids,
        stats.evictions,
        stats.expired,
        stats.admissions,
        stats.zero_row_ids,
    ]


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like[:0]
