"""Fused embedding tables under fault tolerance: roll back a dropped step.

A `FusedEmbeddingBagCollection` updates its rows inside backward, before the step's vote.
`FusedEmbeddingGuard` snapshots, at forward time, every row the batch will touch (weights and
optimizer state) and writes them back if the vote is no; on a sharded collection it does so
per local kernel, from the ids each kernel receives after the input all-to-all. The guard
reports a local gated NaN/inf skip, so the step drops on every replica. Id-mapped tables: the
guard watches their maps (`RemapObserver`), keeps each map step's undo record and saves the
rows a step uses, or re-initialises for new ids, before they change. Keeping tables identical
across replica groups is `recopt/ft/replica_sync.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recopt.ft.embedding_tables import (
    FusedTable,
    collect_tables,
    id_maps_of,
    is_sharded,
    kernel_tables,
    kernels_of,
    scalar_states,
)
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.steps import StepParticipant, StepTransaction
from recopt.modules.collection import FusedCollection
from recopt.modules.id_map import IdMap, MapUndo, Remapped


@dataclass(slots=True)
class _Snapshot:
    table: FusedTable
    ids: torch.Tensor
    weight_rows: torch.Tensor
    state_rows: dict[str, torch.Tensor]  # by ids, for per-row state
    state_whole: dict[str, torch.Tensor]  # scalars, per-column and dense-updated state


class FusedEmbeddingGuard(StepParticipant):
    """Makes a fused embedding collection's in-backward updates part of the step transaction.

    Snapshots are taken in a forward pre-hook, from the input ids, so the guard works with
    every kernel backend and needs nothing from the kernel: the rows backward updates are
    exactly the rows forward looked up. Memory per step: the touched rows of each table's
    weight and state (plus whole scalar / per-column state, and whole per-row state for
    Adafactor, which decays every row).

    On a sharded collection (``recopt.sharding.ShardedEmbeddingBagCollection``, whose fused
    weights are ShardedTensors) the rows a rank updates are only known after the input
    all-to-all, so the pre-hooks sit on the rank's local kernels instead: each kernel's
    forward receives exactly the (local) ids its backward will update, and the guard
    snapshots those rows of its local shards. The step counters the collection keeps for
    tables held on other ranks (advanced at every backward) are copied whole.

    Id-mapped tables (``IdMapConfig``): the guard observes the collection's maps. Each
    training step of a map hands it the step's undo record (restored on a dropped step, so
    the map is bit for bit as before); the rows a step uses are saved once known (after the
    remap, before any reset) and the rows re-initialised for new ids are saved before their
    reset, so an evicted id's old weight and optimizer state come back too.

    Args:
        module: a `FusedEmbeddingBagCollection` (``tables``, ``fused_optimizer``) or a
            sharded one (``kernels()``, ``fused_optimizer``).
        manager: told about this guard so it restores on a dropped step; None to drive
            `on_commit` / `on_abort` yourself.

    Raises:
        ValueError: the module does not expose a table's weight under
            ``embedding_bags.<table>.weight`` in its ``fused_optimizer``.
    """

    def __init__(self, module: nn.Module, manager: StepTransaction | None = None) -> None:
        self._module = module
        self._skips_at_start = self._skipped_steps()
        self._snapshots: list[_Snapshot] = []
        self._scalars: list[torch.Tensor] = []  # sharded: step counters of remote tables
        self._saved_scalars: list[list[torch.Tensor]] = []
        self._map_undos: list[tuple[IdMap, MapUndo]] = []
        self._sharded = is_sharded(module)
        if self._sharded:
            self._tables = []
            self._handles = []
            for kernel in kernels_of(module):
                tables = kernel_tables(kernel)
                self._tables += tables
                hook = functools.partial(self._before_kernel, kernel.feature_table_map, tables)
                self._handles.append(kernel.register_forward_pre_hook(hook))
            self._scalars = scalar_states(module)
            self._handles.append(module.register_forward_pre_hook(self._save_scalars))
        else:
            self._tables = collect_tables(module)
            self._handles = [module.register_forward_pre_hook(self._before_forward)]
        self._maps = id_maps_of(module)
        if self._maps is not None:
            self._maps.add_observer(self)
        if manager is not None:
            manager.register_participant(self)

    def _save_scalars(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled() and self._scalars:
            self._saved_scalars.append([t.clone() for t in self._scalars])

    def _before_kernel(
        self,
        feature_table_map: Sequence[int],
        tables: list[FusedTable],
        kernel: nn.Module,
        args: Any,
    ) -> None:
        """Snapshot, for each local table, the rows this kernel's backward will update."""
        if not torch.is_grad_enabled() or len(args) < 2:
            return
        indices, offsets = args[0], args[1]
        num_features = len(feature_table_map)
        batch = (offsets.numel() - 1) // num_features
        bounds = offsets[::batch].tolist() if batch > 0 else [0] * (num_features + 1)
        for t, table in enumerate(tables):
            parts = [
                indices[bounds[f] : bounds[f + 1]]
                for f, owner in enumerate(feature_table_map)
                if owner == t
            ]
            # Every table, also without ids: its scalar state advances at every backward.
            ids = torch.unique(torch.cat(parts)) if parts else indices.new_zeros(0)
            self.snapshot(table, ids)

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or not args:
            return  # evaluation: backward will not update anything
        features = args[0]
        keys = list(features.keys())
        bounds = features.offset_per_key()
        values = features.values()
        mapped = set() if self._maps is None else set(self._maps)
        for table in self._tables:
            parts = [
                values[bounds[keys.index(f)] : bounds[keys.index(f) + 1]]
                for f in table.features
                if f in keys
            ]
            if parts and table.name in mapped:  # raw ids: the rows come with the map step
                self.snapshot(table, values.new_zeros(0))
            elif parts:
                self.snapshot(table, torch.unique(torch.cat(parts)))

    def map_stepped(self, table: str, idmap: IdMap, result: Remapped) -> None:
        """Keep the map step's undo record; unsharded, save the rows the batch uses now.

        On a sharded collection the local kernels' pre-hooks save the used rows, and
        `before_reset` the re-initialised ones.
        """
        if result.undo is None:
            raise RuntimeError(f"id map of table {table!r} stepped without an undo record")
        self._map_undos.append((idmap, result.undo))
        if self._sharded:
            return
        (fused,) = [t for t in self._tables if t.name == table]
        # Every row the batch reads (its fresh rows among them), before any is reset.
        self.snapshot(fused, torch.unique(result.rows_M[result.rows_M >= 0]))

    def before_reset(
        self,
        table: str,
        weight: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        rows: torch.Tensor,
    ) -> None:
        """Save ``rows`` of a shard (weight and state) before they are re-initialised."""
        if self._sharded:  # unsharded, `map_stepped` saved them already
            self.snapshot(FusedTable(table, (), weight, dict(states), True), rows)

    @torch.no_grad()
    def snapshot(self, table: FusedTable, ids: torch.Tensor) -> None:
        """Save ``ids``' rows of ``table`` (weight and state) as they are now."""
        rows = table.weight.shape[0]
        ids = ids.to(table.weight.device)
        ids = ids[(ids >= 0) & (ids < rows)]  # a bad id: the forward raises, naming it
        state_rows, state_whole = {}, {}
        for key, value in table.states.items():
            if table.rows_only and value.dim() >= 1 and value.shape[0] == rows:
                state_rows[key] = value.index_select(0, ids)
            else:
                state_whole[key] = value.clone()
        weight_rows = table.weight.index_select(0, ids)
        self._snapshots.append(_Snapshot(table, ids, weight_rows, state_rows, state_whole))

    @torch.no_grad()
    def restore(self) -> None:
        """Write every snapshot back, newest first (so a row seen twice gets its oldest value);
        undo every map step, newest first."""
        for snap in reversed(self._snapshots):
            snap.table.weight.index_copy_(0, snap.ids, snap.weight_rows)
            for key, saved in snap.state_rows.items():
                snap.table.states[key].index_copy_(0, snap.ids, saved)
            for key, saved in snap.state_whole.items():
                snap.table.states[key].copy_(saved)
        for saved_scalars in reversed(self._saved_scalars):
            for tensor, saved in zip(self._scalars, saved_scalars, strict=True):
                tensor.copy_(saved)
        for idmap, undo in reversed(self._map_undos):
            idmap.apply_undo(undo)
        self.clear()

    def clear(self) -> None:
        """Forget the current step's snapshots and map undo records."""
        self._snapshots.clear()
        self._saved_scalars.clear()
        for _, undo in self._map_undos:  # never read now: a native one goes uncopied
            undo.release()
        self._map_undos.clear()

    def snapshot_bytes(self) -> int:
        """Memory held by the current step's snapshots and map undo records."""
        tensors: list[torch.Tensor] = []
        for snap in self._snapshots:
            tensors += [snap.ids, snap.weight_rows, *snap.state_rows.values()]
            tensors += list(snap.state_whole.values())
        for _, undo in self._map_undos:
            tensors += [undo.rows, undo.candidate_slots, *undo.row_values.values()]
            tensors += list(undo.candidate_values.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def _skipped_steps(self) -> int:
        module = self._module
        return module.skipped_nonfinite_steps if isinstance(module, FusedCollection) else 0

    def on_start(self) -> None:
        self.clear()  # leftovers of forwards that never reached a vote
        self._skips_at_start = self._skipped_steps()

    def before_vote(self) -> None:
        """Drop the step if the collection skipped its update for a NaN/inf gradient.

        The other replicas updated their tables: without this, the replicas would commit
        different steps (their rows are rolled back on the dropped step instead).

        Raises:
            NonFiniteGradientError: this step's backward was skipped by the collection's gate.
        """
        now = self._skipped_steps()
        skipped, self._skips_at_start = now - self._skips_at_start, now
        if skipped:
            raise NonFiniteGradientError(
                f"{type(self._module).__name__} skipped its fused update for a NaN/inf "
                "gradient; the step is dropped on every replica"
            )

    def on_commit(self) -> None:
        self.clear()

    def on_abort(self) -> None:
        self.restore()

    def remove(self) -> None:
        """Detach the forward pre-hooks and stop observing the id maps."""
        for handle in self._handles:
            handle.remove()
        if self._maps is not None and self in self._maps.observers:
            self._maps.observers.remove(self)
