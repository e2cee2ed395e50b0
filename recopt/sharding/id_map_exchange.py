"""Every id-mapped row shard's statistics of a training step, from its owner to every rank.

The owner of a shard steps its map in the forward (`id_map_sharded`); its statistics then go to
every rank in one small all-to-all, started right after the step and read only when `stats()`
asks (or when the next step starts another), so `stats()` is global and the same everywhere.
Legend: C columns (the row shards of every mapped table, ordered by owner rank), W world size,
S statistics per shard.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt.comm import start_all_to_all_flat, wait
from recopt.sharding.id_map_shards import MapShard

Tensor = torch.Tensor

# What each owner sends per shard after a training step.
STAT_FIELDS = ("step", "occupied", "new_ids", "evictions", "expired", "admissions", "zero_row_ids")


class StatsExchange:
    """Sends this rank's shard statistics to every rank and gathers every shard's.

    Args:
        shards: every row shard of every id-mapped table (`map_shards`).
        world_size: ranks in ``group``.
        rank: this rank in ``group``.
        group: the process group.
        timeout: limit of the wait for the exchange.
        device: where the statistics are exchanged (the collection's device).
    """

    def __init__(
        self,
        shards: Sequence[MapShard],
        world_size: int,
        rank: int,
        group: dist.ProcessGroup | None,
        timeout: datetime.timedelta,
        device: torch.device,
    ) -> None:
        self.columns = sorted(shards, key=lambda s: (s.rank, s.table, s.shard))
        self.mine = [c for c in self.columns if c.rank == rank]
        self._world = world_size
        self._group = group
        self._timeout = timeout
        self._device = device
        self._from = [
            len(STAT_FIELDS) * sum(c.rank == d for c in self.columns) for d in range(world_size)
        ]
        self._in_flight: tuple[Tensor, Any] | None = None

    def start(self, own: Sequence[Sequence[int]]) -> None:
        """Send ``own`` (per shard of `mine`, its `STAT_FIELDS`) to every rank (a collective:
        every rank calls it after its training step). An exchange not read yet is finished
        and dropped first."""
        self.finish()
        flat = torch.tensor([v for row in own for v in row], dtype=torch.int64)
        flat = flat.to(self._device)
        send = flat.repeat(self._world)
        splits = [flat.numel()] * self._world
        self._in_flight = start_all_to_all_flat(send, splits, list(self._from), self._group)

    def finish(self) -> Tensor | None:
        """Every shard's statistics ``[C, S]`` (column order) of the last exchange started
        and not read yet; None when there is none."""
        if self._in_flight is None:
            return None
        recv, work = self._in_flight
        self._in_flight = None
        wait(work, self._timeout)
        return recv.view(len(self.columns), len(STAT_FIELDS))
