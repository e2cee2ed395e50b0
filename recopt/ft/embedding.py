"""Fused embedding tables under fault tolerance: roll back a dropped step, agree across replicas.

A `FusedEmbeddingBagCollection` updates its rows inside backward, before the step's vote.
`FusedEmbeddingGuard` snapshots, at forward time, every row the batch will touch (weights and
optimizer state) and writes them back if the vote is no; on a sharded collection it does so
per local kernel, from the ids each kernel receives after the input all-to-all.
`average_row_gradients` and `union_row_gradients` are the cross-replica halves of the
kernel's ``grad_hook``. A NaN/inf gradient on any replica drops the step on every replica: the
hooks see every replica's row gradients, and the guard reports a local gated skip. Id-mapped
tables: the guard watches their maps (`RemapObserver`), keeps each map step's undo record and
saves the rows a step uses, or re-initialises for new ids, before they change; under
`EmbeddingReplicaSync` their maps step with every replica group's ids (`ReplicaIdExchange`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
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
from recopt.ft.id_map_replicas import exchange_replica_ids, refuse_unsynced_id_maps
from recopt.ft.nonfinite import NonFiniteGradientError, report_nonfinite
from recopt.ft.steps import StepParticipant, StepTransaction
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules.collection import FusedCollection
from recopt.modules.id_map import IdMap, MapUndo, Remapped

logger = logging.getLogger(__name__)


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
            self._maps.observers.append(self)
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


def replica_sync_optimizer(
    optimizer: FusedOptimizerConfig, sync_embeddings: bool
) -> FusedOptimizerConfig:
    """The fused optimizer to build embedding tables with under fault tolerance.

    With ``sync_embeddings`` (`EmbeddingReplicaSync`), the ``auto`` backend becomes
    ``recopt``: its kernels have the ``grad_hook`` that averages row gradients across replica
    groups, fbgemm's do not. A backend the user forced is kept (the sync then says the fix).

    Args:
        optimizer: the tables' fused optimizer as configured.
        sync_embeddings: whether replica groups keep their tables identical.

    Returns:
        ``optimizer``, with ``backend=recopt`` where the rule applies.
    """
    if not sync_embeddings or optimizer.backend != Backend.AUTO:
        return optimizer
    return dataclasses.replace(optimizer, backend=Backend.RECOPT)


def average_row_gradients(
    ids_U: torch.Tensor, all_ids: list[torch.Tensor], all_grads: list[torch.Tensor]
) -> torch.Tensor:
    """This replica's rows' gradients averaged over every replica (0 where one has no row).

    Sums in replica order, so every replica touching a row computes the same bits.

    Args:
        ids_U: this replica's unique row ids, ascending.
        all_ids: every replica's unique ids (ascending), in quorum rank order.
        all_grads: their aggregated row gradients ``[U_r, D]``.

    Returns:
        ``[U, D]`` averaged gradients for ``ids_U``.
    """
    out = all_grads[0].new_zeros(ids_U.numel(), all_grads[0].shape[1])
    if ids_U.numel() == 0:
        return out
    for ids_r, grads_r in zip(all_ids, all_grads, strict=True):
        pos = torch.searchsorted(ids_U, ids_r).clamp(max=ids_U.numel() - 1)
        hit = ids_U[pos] == ids_r
        out.index_add_(0, pos[hit], grads_r[hit])
    return out.div_(len(all_ids))


def union_row_gradients(
    all_ids: list[torch.Tensor], all_grads: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of every replica's rows with their averaged gradients (same on all replicas).

    Returns:
        ``(ids [V] ascending, grads [V, D])``.
    """
    union = torch.unique(torch.cat(all_ids), sorted=True)
    return union, average_row_gradients(union, all_ids, all_grads)


def make_grad_hook(
    manager: StepTransaction, *, union: bool = False
) -> Callable[[int, torch.Tensor, torch.Tensor], Any]:
    """A kernel ``grad_hook`` that averages touched rows' gradients across replica groups.

    Args:
        manager: the replica group's manager (its quorum and gloo group).
        union: return ``(ids, grads)`` over the union of all replicas' rows, for a kernel
            whose hook may widen the row set (what keeps replicas identical); otherwise
            return grads for this replica's own rows (rows only peers touched are then not
            updated here, see docs/fault_tolerance.md).

    Returns:
        ``hook(table_index, ids_U, grads_U_D)``. On a failed collective it returns the
        local gradients and the step is marked errored (it will be dropped and rolled back).
    """

    def hook(table: int, ids_U: torch.Tensor, grads_U_D: torch.Tensor) -> Any:
        gathered_ids = manager.allgather(ids_U)
        gathered_grads = manager.allgather(grads_U_D) if gathered_ids is not None else None
        if gathered_ids is None or gathered_grads is None:
            return (ids_U, grads_U_D) if union else grads_U_D
        if report_nonfinite(manager, gathered_grads, f"table {table}"):
            zeros = torch.zeros_like(grads_U_D)  # the step is dropped and rolled back
            return (ids_U, zeros) if union else zeros
        if union:
            return union_row_gradients(gathered_ids, gathered_grads)
        return average_row_gradients(ids_U, gathered_ids, gathered_grads)

    return hook


@dataclass(slots=True)
class _Touched:
    kernel: int
    table: int
    all_ids: list[torch.Tensor]  # every participant's unique ids, in quorum rank order


class EmbeddingReplicaSync(StepParticipant):
    """Keeps fused tables identical across replica groups (same rows, same updates).

    In backward, each kernel's ``grad_hook`` all-gathers the touched rows' gradients and
    returns their average over the replicas, so every replica that touched a row applies the
    same update to the same state. Rows that only some replicas touched are then sent,
    before the vote, from the lowest-ranked replica that updated them to the others (weight
    and per-row state; the guard snapshots them first, so a dropped step still restores), and
    also before each further training forward of the step, which reads those rows.

    Args:
        module: a `FusedEmbeddingBagCollection` whose kernels have a ``grad_hook`` attribute
            and a ``tables`` list (the recopt backend).
        manager: the replica group's manager.
        guard: the collection's `FusedEmbeddingGuard` (restores the rows written here).

    Raises:
        ValueError: a kernel without ``grad_hook`` (fbgemm), Adafactor (its per-column
            statistics depend on rows this replica never sees), id-mapped tables with
            ``init_fn``, or id-mapped tables of a sharded collection.

    Id-mapped tables: the maps gather every group's raw ids before each training step
    (`ReplicaIdExchange`) and step with the global batch, so a row holds the same id in
    every group; fresh rows get the hashed init, the same values in every group.
    """

    def __init__(
        self, module: nn.Module, manager: StepTransaction, guard: FusedEmbeddingGuard
    ) -> None:
        refuse_unsynced_id_maps(module)  # before any kernel gets a hook
        self._manager = manager
        self._guard = guard
        self._kernels = kernels_of(module)
        by_name = {t.name: t for t in guard._tables}
        self._tables: list[list[FusedTable]] = []
        for k, kernel in enumerate(self._kernels):
            if not kernel.supports_hooks:
                raise ValueError(
                    f"kernel {k} ({type(kernel).__name__}) has no grad_hook, so its rows cannot "
                    "be kept identical across replica groups; use "
                    "FusedOptimizerConfig(backend='recopt'), or sync_embeddings=False to let "
                    "each replica group train its own tables"
                )
            specs = list(kernel.tables)
            self._tables.append([by_name[s.name] for s in specs])
            if any(not t.rows_only for t in self._tables[-1]):
                raise ValueError(
                    f"kernel {k}: fused optimizer {kernel.optimizer.name!r} keeps per-column "
                    "statistics that "
                    "replicas cannot agree on row by row; use another fused optimizer or "
                    "sync_embeddings=False"
                )
            kernel.grad_hook = self._hook_for(k)
        self._touched: list[_Touched] = []
        exchange_replica_ids(module, manager)
        module.register_forward_pre_hook(self._before_forward)
        manager.register_participant(self)

    def _hook_for(self, kernel: int) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
        def hook(table: int, ids_U: torch.Tensor, grads_U_D: torch.Tensor) -> torch.Tensor:
            # The ids travel behind (kernel, table), so that replicas whose hooks ran for
            # different tables drop the step instead of averaging unrelated rows.
            tag = torch.tensor([kernel, table], dtype=ids_U.dtype, device=ids_U.device)
            tagged = self._manager.allgather(torch.cat([tag, ids_U]))
            if tagged is not None and any(not torch.equal(t[:2], tag) for t in tagged):
                seen = sorted({tuple(t[:2].tolist()) for t in tagged})
                self._manager.report_error(
                    RuntimeError(
                        f"replicas ran the row-gradient exchange for different (kernel, table) "
                        f"pairs {seen}; the kernel must call grad_hook for every table on every "
                        "backward, in table order, also with no ids"
                    )
                )
                tagged = None
            all_grads = self._manager.allgather(grads_U_D) if tagged is not None else None
            if tagged is None or all_grads is None:
                return grads_U_D  # errored: the step is dropped and rolled back anyway
            if report_nonfinite(self._manager, all_grads, f"kernel {kernel}, table {table}"):
                return torch.zeros_like(grads_U_D)  # no NaN in any state; rolled back anyway
            all_ids = [t[2:] for t in tagged]
            self._touched.append(_Touched(kernel, table, all_ids))
            return average_row_gradients(ids_U, all_ids, all_grads)

        return hook

    def on_start(self) -> None:
        self._touched.clear()

    def on_commit(self) -> None:
        self._touched.clear()

    def on_abort(self) -> None:
        self._touched.clear()

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # A further training forward in the step reads the rows earlier backwards updated.
        if self._touched and module.training and torch.is_grad_enabled():
            self._exchange_rows()

    def before_vote(self) -> None:
        """Send the rows this replica owns to the replicas that did not update them."""
        self._exchange_rows()

    @torch.no_grad()
    def _exchange_rows(self) -> None:
        rank = self._manager.participant_rank()
        for touched in self._touched:
            table = self._tables[touched.kernel][touched.table]
            owned = _owned_rows(touched.all_ids, rank)
            tensors = [table.weight, *self._row_states(table)]
            gathered_ids = self._manager.allgather(owned)
            gathered = [self._manager.allgather(t.index_select(0, owned)) for t in tensors]
            if gathered_ids is None or any(g is None for g in gathered):
                self._touched.clear()  # errored: the step is dropped and rolled back
                return
            mine = touched.all_ids[rank]
            for r, ids_r in enumerate(gathered_ids):
                missing = ~torch.isin(ids_r, mine)
                if r == rank or not bool(missing.any()):
                    continue
                self._guard.snapshot(table, ids_r[missing])
                for t, rows in zip(tensors, gathered, strict=True):
                    assert rows is not None
                    t.index_copy_(0, ids_r[missing], rows[r][missing])
        self._touched.clear()

    @staticmethod
    def _row_states(table: FusedTable) -> list[torch.Tensor]:
        rows = table.weight.shape[0]
        return [v for _, v in sorted(table.states.items()) if v.dim() >= 1 and v.shape[0] == rows]


def _owned_rows(all_ids: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rows ``rank`` sends: it touched them, no lower rank did, and some rank did not."""
    mine = all_ids[rank]
    keep = torch.zeros_like(mine, dtype=torch.bool)  # someone lacks the row
    for ids_r in all_ids:
        keep |= ~torch.isin(mine, ids_r)
    for ids_r in all_ids[:rank]:
        keep &= ~torch.isin(mine, ids_r)
    return mine[keep]
