"""Id-mapped tables in ShardedEmbeddingBagCollection: one replica of each table's map per rank.

Every rank gathers the raw ids of all ranks' id-mapped features (one header and one id
all-gather per training step) and steps its copy of the map with that global batch, so the
maps stay equal on every rank, and equal to an unsharded collection's map fed the ranks'
batches concatenated (a map step depends only on the ids and their counts). Each rank then
rewrites its own ids to rows, and the ordinary sharded path routes them as row numbers; each
rank re-initialises the fresh rows its shards hold (the hashed init: the same values in every
layout) and zeroes their per-row optimizer state (the maps' observers told first: fault
tolerance's guard). Outside training the local copy is read.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt.comm import all_gather_sized
from recopt.kernels.contract import Kernel
from recopt.modules.config import EmbeddingBagConfig
from recopt.modules.id_map import Remapped
from recopt.modules.id_map_lookup import (
    IdMaps,
    MappedBatch,
    apply_rows,
    hash_uniform,
    refuse_init_fn,
    reset_state_rows,
    step_with_peers,
    table_ids,
    unmapped_check,
)
from recopt.modules.inputs import FeatureLayout, PendingCheck
from recopt.modules.variable_batch import regular_batch
from recopt.sharding.bucketizer import Bucketizer
from recopt.sharding.input_dist import start_count_exchange
from recopt.sharding.input_stage import DistributedInput
from recopt.sharding.layout import GroupLayout, ShardedLayout
from recopt.sparse import KeyedJaggedTensor

_STATE_PREFIX = "id_maps."


class ShardedIdMaps:
    """The id maps of a sharded collection (a replica on every rank) and its fresh-row reset.

    Args:
        tables: the collection's tables.
        layout: the sharded layout (which shards this rank's kernels hold).
        kernels: this rank's kernels, model-parallel groups first, then data-parallel.
        group: the collection's process group.
        device: where the maps live.
        timeout: limit of the id all-gather.
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
        self.maps = IdMaps(tables, device)
        self.tables = list(tables)
        self._groups: list[GroupLayout] = [*layout.mp_groups, *layout.dp_groups]
        self._layout = layout
        self._kernels = list(kernels)
        self._pg = group
        self._rank = dist.get_rank(group)
        self._timeout = timeout

    def prepare(
        self,
        features: KeyedJaggedTensor | None,
        layout: FeatureLayout,
        is_weighted: bool,
        training: bool,
    ) -> tuple[MappedBatch | None, KeyedJaggedTensor | None, PendingCheck | None]:
        """`FeatureLayout.prepare_deferred` with the mapped ids rewritten to rows first.

        Every rank calls it once per forward (in training the id gather is a collective); a
        rank whose input already failed passes ``features=None`` and gets Nones back.

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
    ) -> DistributedInput:
        """`input_stage.start_distribution` with the mapped ids rewritten to rows first."""
        prepared: KeyedJaggedTensor | None = None
        check: PendingCheck | None = None
        index_F_B: torch.Tensor | None = None
        error: ValueError | None = None
        mapped: MappedBatch | None = None
        try:
            regular, index_F_B = regular_batch(features, layout.feature_names)
            mapped, prepared, check = self.prepare(regular, layout, is_weighted, training)
        except ValueError as e:
            error = e
            if mapped is None and prepared is None:  # the other ranks' id gather needs us
                self.prepare(None, layout, is_weighted, training)
        counts = start_count_exchange(
            prepared, error, bucketizer, is_weighted, self._pg, self._rank, check
        )
        started = DistributedInput(features, prepared, index_F_B, counts)
        started.mapped = mapped
        return started

    def remap(
        self, features: KeyedJaggedTensor | None, layout: FeatureLayout, training: bool
    ) -> MappedBatch | None:
        """This rank's selected ``features`` with mapped ids as rows (None: this rank's input
        already failed; it still joins the gather).

        When any rank's input is bad (None, a bad id of an unmapped table, a NaN weight), no
        map moves and the mapped ids become row 0, so the input check that follows names the
        real culprit on every rank.
        """
        names = list(self.maps)
        if not training:
            if features is None:
                return None
            ids = table_ids(features, layout, names)
            results = {n: self.maps.table_map(n).remap(ids[n], False) for n in names}
            return apply_rows(features, layout, results)
        local: dict[str, torch.Tensor] = {}
        bad = features is None
        if features is not None:
            check = unmapped_check(features, layout, names).bad
            bad = check is not None and bool(check)
            local = table_ids(features, layout, names)
        counts = [local[n].numel() if local else 0 for n in names]
        header = torch.tensor([sum(counts), int(bad), *counts], dtype=torch.int64)
        device = self.maps.table_map(names[0]).step.device
        assert isinstance(device, torch.device)
        values = torch.cat(list(local.values())) if local else torch.zeros(0, dtype=torch.int64)
        headers, gathered = all_gather_sized(
            header.to(device), values.to(device, torch.int64), self._pg, self._timeout
        )
        if any(int(h[1]) for h in headers):
            if features is None:
                return None
            zeros = {
                n: Remapped(torch.zeros_like(local[n]), local[n][:0], local[n][:0]) for n in names
            }
            return apply_rows(features, layout, zeros)
        assert features is not None
        per_rank = [
            dict(zip(names, g.split(h[2:].tolist()), strict=True))
            for h, g in zip(headers, gathered, strict=True)
        ]
        results = step_with_peers(self.maps, per_rank, self._rank)
        self._reset_fresh(results)
        return apply_rows(features, layout, results)

    def _reset_fresh(self, results: Mapping[str, Remapped]) -> None:
        """Re-initialise the fresh rows this rank's shards hold; zero their optimizer state."""
        fresh_tables = {n for n, r in results.items() if r.fresh_rows.numel()}
        for group, kernel in zip(self._groups, self._kernels, strict=True):
            if not any(self.tables[t].name in fresh_tables for t, _ in group.tables):
                continue  # nothing to reset: no need to split the kernel's weights and states
            weights = kernel.split_embedding_weights()
            states = kernel.split_optimizer_states()
            for (t, k), weight, state in zip(group.tables, weights, states, strict=True):
                table = self.tables[t]
                fresh = results.get(table.name)
                if fresh is None or fresh.fresh_rows.numel() == 0:
                    continue
                if k < 0:  # a data-parallel replica: the whole table
                    row0, num_rows, col0 = 0, table.num_embeddings, 0
                else:
                    shard = self._layout.shardings[t].shards[k]
                    row0, num_rows, col0 = shard.row_offset, shard.num_rows, shard.col_offset
                held = (fresh.fresh_rows >= row0) & (fresh.fresh_rows < row0 + num_rows)
                rows = fresh.fresh_rows[held] - row0
                if rows.numel():  # the guard saves their old values first
                    self.maps.before_reset(table.name, weight, state, rows)
                lo, hi = table.init_bounds()
                unit = hash_uniform(fresh.fresh_ids[held], fresh.stats.step, table.embedding_dim)
                values = (lo + (hi - lo) * unit)[:, col0 : col0 + weight.shape[1]]
                with torch.no_grad():
                    weight[rows] = values.to(weight.dtype)
                reset_state_rows(group.optimizer.name, state, rows)

    def save(self, destination: dict[str, Any], prefix: str) -> None:
        """Write the maps' buffers (replicated tensors) under ``<prefix>id_maps.``."""
        for key, value in self.maps.state_dict().items():
            destination[f"{prefix}{_STATE_PREFIX}{key}"] = value

    def load(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        missing_keys: list[str],
    ) -> None:
        """Copy the maps' buffers from ``state_dict`` (missing ones are reported)."""
        for key, value in self.maps.state_dict().items():
            full = f"{prefix}{_STATE_PREFIX}{key}"
            if full not in state_dict:
                missing_keys.append(full)
                continue
            with torch.no_grad():
                value.copy_(state_dict[full])

    @staticmethod
    def owns(key: str) -> bool:
        """Whether a state key (without the module prefix) is one of the maps'."""
        return key.startswith(_STATE_PREFIX)
