"""The exchange of owner-local id maps: raw ids to the row shards that own them, rows back.

Each raw id of an id-mapped table belongs to the row shard `route_shard` names (a fixed hash of
the id). A forward sends every rank's ids to their owners in one all-to-all (after a count
exchange that carries a "my input is bad" flag, so every rank knows), each owner remaps the
ids it received (all sources concatenated in source order), and a second all-to-all returns
the global rows, in training with each owner's shard statistics appended.
Legend: M this rank's ids (all mapped tables), C columns (the row shards of every mapped
table, ordered by owner rank), W world size, R ids received, S statistics per shard.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recopt.comm import start_all_to_all_counts, start_all_to_all_flat, wait
from recopt.modules.id_map_results import to_device
from recopt.modules.id_map_rows import route_shard
from recopt.sharding.id_map_shards import MapShard

Tensor = torch.Tensor

# What each owner sends back per shard after a training step, after its rows.
STAT_FIELDS = ("step", "occupied", "new_ids", "evictions", "expired", "admissions", "zero_row_ids")


@dataclass(slots=True)
class RoutedIds:
    """This rank's ids sorted by destination column (`IdExchange.route`)."""

    ids_M: Tensor  # sorted by column (owner rank first)
    order_M: Tensor  # where each sorted id sits in the tables' ids concatenated
    counts_C: Tensor  # ids per column


@dataclass(slots=True)
class ReceivedIds:
    """The ids this rank's shards received: per own column, every source's in source order."""

    routed: RoutedIds
    ids_R: Tensor  # sorted by column, then source
    perm_R: Tensor  # their positions in the received buffer
    column_sizes: list[int]  # per own column (`IdExchange.mine`)
    send_splits: list[int]
    recv_splits: list[int]


class IdExchange:
    """Routes and exchanges the raw ids of a collection's id-mapped tables.

    Args:
        shards: every row shard of every id-mapped table (`map_shards`).
        names: the id-mapped tables, in the order their ids are concatenated.
        world_size: ranks in ``group``.
        rank: this rank in ``group``.
        group: the process group.
        timeout: limit of each collective.
        device: where counts and ids are exchanged (the collection's device).
    """

    def __init__(
        self,
        shards: Sequence[MapShard],
        names: Sequence[str],
        world_size: int,
        rank: int,
        group: dist.ProcessGroup | None,
        timeout: datetime.timedelta,
        device: torch.device,
    ) -> None:
        self.columns = sorted(shards, key=lambda s: (s.rank, s.table, s.shard))
        self.mine = [c for c in self.columns if c.rank == rank]
        self._first_mine = next((i for i, c in enumerate(self.columns) if c.rank == rank), 0)
        self._names = list(names)
        self._world = world_size
        self._group = group
        self._timeout = timeout
        self._device = device
        index = {(c.name, c.shard): i for i, c in enumerate(self.columns)}
        # The column of each (table, shard), tables in ``names`` order: table t's shard k at
        # ``_first_T[t] + k``; sorted on as int16 (3x faster than int64 on a CPU) when it fits.
        counts = [self._num_shards(name) for name in self._names]
        self._columns = torch.tensor(
            [
                index[(name, k)]
                for name, n in zip(self._names, counts, strict=True)
                for k in range(n)
            ],
            dtype=torch.int64,
            device=device,
        )
        self._first_T = torch.tensor(
            [sum(counts[:t]) for t in range(len(counts))], dtype=torch.int64, device=device
        )
        self._shards_T = torch.tensor(counts, dtype=torch.int64, device=device)
        # one shard count for all tables (an int: the cheaper modulo), or None
        self._uniform = counts[0] if counts and all(n == counts[0] for n in counts) else None
        self._key = torch.int16 if len(self.columns) < 2**15 else torch.int64
        owner = torch.tensor([c.rank for c in self.columns], device=device)
        self._dest_W_C = owner.unsqueeze(0) == torch.arange(world_size, device=device).unsqueeze(1)
        self._stats_from = [
            len(STAT_FIELDS) * sum(c.rank == d for c in self.columns) for d in range(world_size)
        ]

    def _num_shards(self, name: str) -> int:
        return next(c.num_shards for c in self.columns if c.name == name)

    def route(self, ids: Mapping[str, Tensor]) -> RoutedIds:
        """This rank's ids by table, sorted by the column (owner shard) each belongs to."""
        parts = [ids[name].to(self._device, torch.int64) for name in self._names]
        ids_M = torch.cat(parts)
        # All tables' ids hashed at once (a table's own hash is ~12 ops: launches on a GPU).
        sizes = to_device(torch.tensor([p.numel() for p in parts]), self._device)  # no wait
        first_M = self._first_T.repeat_interleave(sizes, output_size=ids_M.numel())
        if self._uniform != 1:
            shards: int | Tensor = (
                self._uniform
                if self._uniform is not None
                else self._shards_T.repeat_interleave(sizes, output_size=ids_M.numel())
            )
            first_M = first_M + route_shard(ids_M, shards)
        column_M = self._columns.index_select(0, first_M)  # (faster than [] on a CPU)
        order_M = torch.sort(column_M.to(self._key), stable=True).indices
        counts_C = torch.zeros(len(self.columns), dtype=torch.int64, device=self._device)
        counts_C.index_add_(0, column_M, torch.ones_like(column_M))  # no size from the data
        return RoutedIds(ids_M.index_select(0, order_M), order_M, counts_C)

    def send_ids(self, routed: RoutedIds | None, bad: bool) -> ReceivedIds | None:
        """Send the ids to their owners (every rank calls it; ``routed`` None when ``bad``).

        A count exchange first, with the flag ``bad`` (this rank's input failed): when any
        rank's is set, nothing more is sent and every rank gets None.
        """
        counts_W_C = torch.zeros(
            self._world, 1 + len(self.columns), dtype=torch.int64, device=self._device
        )
        counts_W_C[:, 0] = int(bad or routed is None)
        if routed is not None and not bad:
            counts_W_C[:, 1:] = routed.counts_C.unsqueeze(0) * self._dest_W_C
        recv_W_C, work = start_all_to_all_counts(counts_W_C, self._group)
        wait(work, self._timeout)
        sent, received = torch.stack([counts_W_C, recv_W_C]).tolist()  # the one host read
        if any(row[0] for row in received) or routed is None or bad:
            return None
        send_splits = [sum(row[1:]) for row in sent]
        recv_splits = [sum(row[1:]) for row in received]
        ids_R, work = start_all_to_all_flat(routed.ids_M, send_splits, recv_splits, self._group)
        wait(work, self._timeout)
        # Received: per source, its ids column after column; regroup by column, sources in order.
        columns = torch.arange(len(self.columns), device=self._device).repeat(self._world)
        labels_R = torch.repeat_interleave(
            columns, recv_W_C[:, 1:].reshape(-1), output_size=ids_R.numel()
        )
        perm_R = torch.sort(labels_R.to(self._key), stable=True).indices
        first = self._first_mine
        sizes = [sum(row[1 + first + i] for row in received) for i in range(len(self.mine))]
        ids_R = ids_R.index_select(0, perm_R)
        return ReceivedIds(routed, ids_R, perm_R, sizes, send_splits, recv_splits)

    def send_rows(
        self, received: ReceivedIds, rows_R: Tensor, stats: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Return the rows of the received ids to their sources (a collective).

        Args:
            received: what `send_ids` gave.
            rows_R: a global row per id of ``received.ids_R`` (same order; -1: zero row).
            stats: training: ``[len(mine), S]`` int64 statistics of this rank's shards (sent
                to every rank after its rows); None in evaluation (every rank passes None).

        Returns:
            This rank's rows in its tables' ids concatenated, and in training every shard's
            statistics ``[C, S]`` (column order).
        """
        back_R = torch.empty_like(rows_R)
        back_R.index_copy_(0, received.perm_R, rows_R)
        blocks = list(back_R.split(received.recv_splits))
        own_stats = 0
        if stats is not None:
            flat = stats.reshape(-1).to(back_R)
            own_stats = flat.numel()
            blocks = [part for block in blocks for part in (block, flat)]
        send_splits = [n + own_stats for n in received.recv_splits]
        extra = self._stats_from if stats is not None else [0] * self._world
        recv_splits = [n + e for n, e in zip(received.send_splits, extra, strict=True)]
        recv, work = start_all_to_all_flat(torch.cat(blocks), send_splits, recv_splits, self._group)
        wait(work, self._timeout)
        parts = recv.split(recv_splits)
        sizes = received.send_splits
        rows_sorted = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        rows_M = torch.empty_like(rows_sorted)
        rows_M.index_copy_(0, received.routed.order_M, rows_sorted)
        if stats is None:
            return rows_M, None
        every = torch.cat([p[n:] for p, n in zip(parts, sizes, strict=True)])
        return rows_M, every.view(len(self.columns), len(STAT_FIELDS))
