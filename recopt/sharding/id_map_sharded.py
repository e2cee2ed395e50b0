"""Id-mapped tables in ShardedEmbeddingBagCollection: each row shard keeps the map of its rows.

Every id of an id-mapped table belongs to one row shard (`route_shard`, a hash of the raw id);
the rank holding that shard keeps the shard's map (`id_map_shards`). The ordinary input
distribution sends each raw id to that shard (`Bucketizer`, ``hashed``), unchanged; the owner
then steps its shard map once with the ids of every source (`ShardedIdMaps.remap`, in the
forward, on the kernels' inputs), re-initialises the fresh rows of its shard (the hashed init)
and zeroes their optimizer state, the maps' observers told first (fault tolerance's guard),
and looks the rows up. Ids left without a row (the zero row) are dropped from their bags there;
their sources divide mean-pooled bags by the full bag length, so those ids count as zeros.
Statistics go from each owner to every rank after the step (`StatsExchange`), so `stats()` is
global and equal on every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt.kernels.contract import Kernel
from recopt.modules.config import EmbeddingBagConfig
from recopt.modules.id_map import Remapped, RemapStats
from recopt.modules.id_map_ahead import AheadRemap
from recopt.modules.id_map_batch import drop_zero_rows
from recopt.modules.id_map_lookup import IdMaps, refuse_init_fn, step_with_peers
from recopt.modules.id_map_native import remap_tables
from recopt.modules.id_map_results import results_to
from recopt.modules.id_map_rows import FreshTable, ResetTarget, reset_fresh_tables
from recopt.sharding.id_map_exchange import STAT_FIELDS, StatsExchange
from recopt.sharding.id_map_relocate import ShardRows, relocate
from recopt.sharding.id_map_shards import MapShard, map_shards, map_state, shard_map, step_counter
from recopt.sharding.input_dist import ReceivedInput
from recopt.sharding.input_stage import DistributedInput
from recopt.sharding.kernel_inputs import KernelInput
from recopt.sharding.layout import ShardedLayout
from recopt.sharding.state import _copy_overlaps, quiet_sharded_tensor

_STATE_PREFIX = "id_maps."


class ShardedIdMaps:
    """The owner-local id maps of a sharded collection.

    ``maps`` holds, per id-mapped table, this rank's shard map, or a one-row map stepped with
    no ids where the rank holds no shard of the table (its ``step``: the table's step counter
    is kept on every rank).

    Args:
        tables: the collection's tables.
        layout: the sharded layout (which shards this rank's kernels hold).
        kernels: this rank's kernels, model-parallel groups first, then data-parallel.
        group: the collection's process group.
        device: where the collection computes.
        timeout: limit of each collective (the statistics, a relocation).

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
        self._exchange = StatsExchange(
            self._shards, dist.get_world_size(group), self._rank, group, timeout, device
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
        # Where each own shard's ids are in the model-parallel kernels' inputs: (kernel, its
        # first feature, the feature after its last), in `mine` order (a table's features are
        # contiguous in its kernel).
        self._spans: list[tuple[int, int, int]] = []
        for shard in self._exchange.mine:
            found = [
                (g, f)
                for g, group_layout in enumerate(layout.mp_groups)
                for f, vf in enumerate(group_layout.features)
                if (vf.table, vf.shard) == (shard.table, shard.shard)
            ]
            kernel_index = found[0][0]
            first, last = found[0][1], found[-1][1]
            assert all(g == kernel_index for g, _ in found) and len(found) == last - first + 1
            self._spans.append((kernel_index, first, last + 1))
        # Each own shard's weight and optimizer state views, made at its first fresh rows.
        self._views: dict[tuple[int, int], ResetTarget] = {}
        self._stats = {name: RemapStats() for name in self.names}
        self.relocate_pending = False

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table, the last training step's statistics over all its shards."""
        every = self._exchange.finish()
        if every is not None:
            self._record_stats(every)
        return {name: self._stats[name].as_dict() for name in self.names}

    def input_failed(self, training: bool) -> None:
        """This batch's input was rejected (here or on another rank): no map moves. Under
        replica sync the other replica groups wait for this one's ids: they learn that every
        group drops the step."""
        if training and self.maps.peers is not None:
            self.maps.peers.gather({}, True)

    def remap(self, inputs: Sequence[KernelInput], training: bool) -> list[KernelInput]:
        """The model-parallel kernels' ``inputs`` with the raw ids of this rank's shards
        mapped to their local rows (a training step of every map here: each shard's once with
        the ids of every source; evaluation only reads), the ids left without a row dropped
        from their bags, the fresh rows reset. Every rank calls it in every forward (the
        step counters step, and the statistics are a collective in training). A step taken
        ahead and not taken by its forward (`start_ahead`) is undone first: this batch comes
        before it.

        After a load, the first call moves the loaded ids to their owner shards first
        (`_relocate_if_pending`, a collective).
        """
        self.maps.rewind_ahead()
        self._relocate_if_pending()
        out, results = self._map_inputs(inputs, training)
        if training:
            self._finish_step(results)
        return out

    def start_ahead(
        self, started: DistributedInput, inputs_of: Callable[[ReceivedInput], list[KernelInput]]
    ) -> None:
        """A pipeline started batch i+1's id all-to-all (after batch i's forward): map its ids
        on the worker thread once they arrive, during batch i's backward (`remap_worker`), the
        step recorded for undo and kept pending (`IdMaps.ahead`) until batch i+1's forward
        takes it (`take_ahead`: the fresh rows are reset then, after batch i's update).
        Nothing starts under fault tolerance (its observers and peers step the maps in the
        forward), before a pending relocation, or for a rejected batch."""
        if (
            started.in_flight is None
            or started.error is not None
            or self.relocate_pending
            or not self.maps.can_step_ahead()
        ):
            return
        remap = AheadRemap(started.features, self.maps.ahead.generation)
        in_flight = started.in_flight

        def step() -> None:
            inputs = inputs_of(in_flight.wait(self._timeout))
            out, results = self._map_inputs(inputs, True, record_undo=True)
            remap.undo.update({n: r.undo for n, r in results.items() if r.undo is not None})
            remap.mapped = (out, results)

        started.ahead = self.maps.ahead.submit(remap, step, background=True)

    def take_ahead(self, started: DistributedInput, training: bool) -> list[KernelInput] | None:
        """The kernels' inputs ``started``'s step taken ahead made (its fresh rows reset now,
        once, and its statistics sent); None when there is none, it was undone since (an
        evaluation, a load, a training forward outside the pipeline) or the collection is not
        ``training`` (put in eval mode after the step started): the forward maps the ids
        itself (`remap`, which undoes the ahead steps first)."""
        remap = started.ahead
        if remap is None or not training:
            return None
        taken = self.maps.ahead.take(remap)
        if taken is None:
            return None
        out, results = taken.mapped
        if not taken.rows_reset:
            taken.rows_reset = True
            self._finish_step(results)
        return list(out)

    def _map_inputs(
        self, inputs: Sequence[KernelInput], training: bool, record_undo: bool = False
    ) -> tuple[list[KernelInput], dict[str, Remapped]]:
        """`remap`'s map step (or read) and the inputs with rows, fresh rows not reset."""
        mine = self._exchange.mine
        parts = [
            inputs[k].ids[inputs[k].bounds[a] : inputs[k].bounds[b]] for k, a, b in self._spans
        ]
        home = self.maps.home
        sizes = [p.numel() for p in parts]
        flat = _cat(parts, inputs[0].ids if inputs else torch.zeros(0, dtype=torch.int64))
        flat = flat.to(home, torch.int64)  # (maps kept on the host: one copy)
        ids = dict(zip([s.name for s in mine], flat.split(sizes), strict=True))
        if training:
            # the step counters of the tables held elsewhere step too (with no ids)
            ids.update({name: flat[:0] for name in self.names if name not in ids})
            results = self._step_maps(ids, record_undo)
        else:
            results = remap_tables({s.name: self.maps.table_map(s.name) for s in mine}, ids, False)
        rows = [results[s.name].rows_M for s in mine]
        zero = [results[s.name].reads_zero_row() for s in mine]  # (on the host: no sync)
        if inputs:  # the rows where the kernels are, in one copy
            rows = list(_cat(rows, flat).to(inputs[0].ids.device, inputs[0].ids.dtype).split(sizes))
        return self._with_rows(inputs, rows, zero), results

    def _finish_step(self, results: Mapping[str, Remapped]) -> None:
        """A training step's fresh rows reset (the observers told first), and every shard's
        statistics sent to every rank (a collective)."""
        mine = self._exchange.mine
        fresh = {s.name: results[s.name] for s in mine if results[s.name].fresh_rows.numel()}
        fresh = results_to(fresh, self._device)  # the rows to reset, where the tables are
        reset_fresh_tables(
            self.maps, [self._fresh_table(s, fresh[s.name]) for s in mine if s.name in fresh]
        )
        self._exchange.start([_shard_stats(s, results[s.name].stats) for s in mine])

    def _with_rows(
        self, inputs: Sequence[KernelInput], rows: Sequence[torch.Tensor], zero_row: list[bool]
    ) -> list[KernelInput]:
        """``inputs`` with each own shard's ids replaced by its ``rows`` (`_spans` order, where
        the kernels are; ``zero_row``: whether they hold the zero row, -1), the zero row's ids
        dropped from their bags."""
        out = list(inputs)
        own = list(zip(self._spans, rows, zero_row, strict=True))
        for k in sorted({k for k, _, _ in self._spans}):
            x = inputs[k]
            spans = sorted(
                ((a, b, r, z) for (kk, a, b), r, z in own if kk == k), key=lambda s: s[0]
            )
            pieces, at = [], 0
            mapped = [False] * (len(x.bounds) - 1)
            zero = False
            for a, b, r, z in spans:
                pieces.append(x.ids[x.bounds[at] : x.bounds[a]])
                pieces.append(r)
                mapped[a:b] = [True] * (b - a)
                zero = zero or z
                at = b
            pieces.append(x.ids[x.bounds[at] :])
            ids = torch.cat(pieces)
            if not zero:
                out[k] = KernelInput(ids, x.offsets, x.weights, x.bounds)
                continue
            kept, weights, lengths, per_key = drop_zero_rows(
                ids, x.offsets, x.bounds, mapped, x.weights
            )
            offsets = torch.zeros(lengths.numel() + 1, dtype=x.offsets.dtype, device=ids.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
            bounds = [0]
            for n in per_key:
                bounds.append(bounds[-1] + n)
            out[k] = KernelInput(kept, offsets, weights, bounds)
        return out

    def _step_maps(
        self, ids: dict[str, torch.Tensor], record_undo: bool = False
    ) -> dict[str, Remapped]:
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
        return self.maps.step_many(ids, record_undo)

    def _fresh_table(self, shard: MapShard, result: Remapped) -> FreshTable:
        """The shard's fresh rows to re-initialise (hashed init), with its weight and optimizer
        state (their zeroing)."""
        key = (shard.table, shard.shard)
        if key not in self._views:  # the kernel's views, made once (fbgemm's: ~35 us a call)
            kernel, i, optimizer_name = self._where[key]
            self._views[key] = ResetTarget.of(
                self.tables[shard.table],
                optimizer_name,
                kernel.split_embedding_weights()[i],
                kernel.split_optimizer_states()[i],
            )
        return FreshTable(self._views[key], result)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the collection) makes its own views of its kernels,
        and holds the statistics read so far (none in flight)."""
        self.stats()  # the exchange in flight, read
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
        self.maps.rewind_ahead()  # (a load may leave some maps out: as the plain loop's)
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
