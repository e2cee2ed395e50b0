"""Fused embedding tables kept identical across replica groups (`EmbeddingReplicaSync`).

`average_row_gradients` is the cross-replica half of the kernel's ``grad_hook``: every
replica that touched a row applies the same averaged update, and rows only some replicas
touched are sent to the others before the vote. A NaN/inf gradient on
any replica drops the step on every replica (the hooks see every replica's row gradients).
Id-mapped tables step their maps with every replica group's ids (`ReplicaIdExchange`,
recopt/ft/id_map_replicas.py). Rolling back a dropped step is `FusedEmbeddingGuard`'s
(recopt/ft/embedding.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.embedding_tables import FusedTable, kernels_of
from recopt.ft.id_map_replicas import exchange_replica_ids, refuse_unsynced_id_maps
from recopt.ft.nonfinite import report_nonfinite
from recopt.ft.steps import StepParticipant, StepTransaction
from recopt.kernels.config import Backend, FusedOptimizerConfig


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
            statistics depend on rows this replica never sees), or id-mapped tables with
            ``init_fn``.

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
