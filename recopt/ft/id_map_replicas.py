"""Id-mapped tables across replica groups: every group steps its maps with the global batch.

`EmbeddingReplicaSync` averages row gradients across replica groups, which needs a row to hold
the same id in every group. `ReplicaIdExchange` (the maps' ``peers``) all-gathers the raw ids
of the id-mapped features before each training map step, in participant rank order, so every
group steps its maps with the same concatenated batch and rewrites only its own ids to rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from recopt.ft.embedding_tables import id_maps_of
from recopt.ft.steps import StepTransaction
from recopt.modules.id_map_lookup import IdMaps, refuse_init_fn


class ReplicaIdExchange:
    """`PeerIds` over a replica group's manager: one all-gather per training map step.

    Each group sends ``[bad, count per table, ids of every table]`` (int64). A failed gather
    (the manager is told) or a group whose input failed its check (reported here) returns
    None: the maps step with the local ids and the dropped step's rollback undoes it.

    Every replica group must run the same number of training forwards per step (each is a
    collective), as the row-gradient exchange already requires.

    Args:
        manager: the replica group's manager.
        maps: the collection's id maps (their table order is the wire order).
    """

    def __init__(self, manager: StepTransaction, maps: IdMaps) -> None:
        self._manager = manager
        self._names = list(maps)
        step = maps.table_map(self._names[0]).step
        assert isinstance(step, torch.Tensor)
        self._device = step.device

    def gather(
        self, ids: Mapping[str, torch.Tensor], bad: bool
    ) -> tuple[list[dict[str, torch.Tensor]], int] | None:
        """Every group's ids by table, in participant rank order, and this group's rank."""
        empty = torch.zeros(0, dtype=torch.int64, device=self._device)
        parts = [ids.get(n, empty).to(self._device, torch.int64) for n in self._names]
        header = torch.tensor(
            [int(bad), *(p.numel() for p in parts)], dtype=torch.int64, device=self._device
        )
        gathered = self._manager.allgather(torch.cat([header, *parts]))
        if gathered is None:
            return None  # errored: the step is dropped and rolled back
        num = len(self._names)
        bad_groups = [r for r, g in enumerate(gathered) if int(g[0])]
        if bad_groups:
            self._manager.report_error(
                ValueError(
                    f"replica groups at ranks {bad_groups} had a bad input batch (their error "
                    "names it); the step is dropped on every replica group"
                )
            )
            return None
        per_group = [
            dict(zip(self._names, g[1 + num :].split(g[1 : 1 + num].tolist()), strict=True))
            for g in gathered
        ]
        return per_group, self._manager.participant_rank()


def exchange_replica_ids(module: nn.Module, manager: StepTransaction) -> None:
    """Have ``module``'s id maps (if any) step with every replica group's ids.

    Raises:
        ValueError: as `refuse_unsynced_id_maps`.
    """
    refuse_unsynced_id_maps(module)
    maps = id_maps_of(module)
    if maps is not None:
        maps.sync_with(ReplicaIdExchange(manager, maps))


def refuse_unsynced_id_maps(module: nn.Module) -> None:
    """Raise if ``module``'s id-mapped tables cannot be kept identical across replica groups.

    A sharded collection's shard maps are exchanged shard by shard (`ShardedIdMaps`: each
    rank gathers, across the groups, the ids its shards received), which needs the same plan
    in every group; its tables refused ``init_fn`` already.

    Raises:
        ValueError: an id-mapped table has ``init_fn``.
    """
    maps = id_maps_of(module)
    if maps is None:
        return
    tables = getattr(module, "tables", [])
    refuse_init_fn(tables, "in every replica group", "use sync_embeddings=False")
