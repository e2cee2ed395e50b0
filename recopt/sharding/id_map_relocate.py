"""Moving id-mapped rows to the row shard that owns their id, after a load under another plan.

A sharded id-mapped table keeps on each row shard the map of the ids that `route_shard` gives
it. A checkpoint loaded under another plan or world size puts each saved row on whichever rank
now holds that row range, so live ids sit on the wrong shard; `relocate` sends each such row,
with its id, counters, weight row and per-row / per-element optimizer state, to its owner (one
count all-to-all and one byte all-to-all for all tables), and admission candidates likewise.
Legend: N rows of a shard, W ranks, T tables, R bytes of one row's record.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recopt import comm
from recopt.modules.id_map import IdMap, policy_eviction_order
from recopt.modules.id_map_rows import route_shard, row_states

__all__ = ["RelocationReport", "ShardRows", "TableRelocation", "relocate", "relocate_in_process"]

logger = logging.getLogger(__name__)

# Per table in the count exchange: rows sent, candidates sent, bytes of one row's record.
_HEADER = 3
_CANDIDATE_BYTES = 24  # a candidate's record: id, count, last_seen (int64 each)


@dataclass
class ShardRows:
    """This rank's row shard of one id-mapped table, as loaded.

    Attributes:
        index: which row shard it is (`route_shard`'s value for the ids it owns).
        idmap: the shard's map; its capacity is the shard's rows.
        weight: ``[N, D]``, writable in place (the kernel's view of the shard).
        states: the shard's optimizer states by name (writable views); the optimizer's
            per-row (``[N]``) and per-element (``[N, D]``) states move with their rows, any
            other (per-column, scalar) stays as it is.
        optimizer: the optimizer's name (its registry spec names the states' shapes).
    """

    index: int
    idmap: IdMap
    weight: torch.Tensor
    states: Mapping[str, torch.Tensor]
    optimizer: str


@dataclass
class TableRelocation:
    """What `relocate` did to this rank's shard of one table (counts of ids)."""

    rows_sent: int = 0
    rows_received: int = 0
    rows_dropped: int = 0
    candidates_sent: int = 0
    candidates_received: int = 0
    candidates_dropped: int = 0


@dataclass
class RelocationReport:
    """This rank's counts per table (a table this rank holds no shard of counts zeros).

    Summed over the ranks: ``rows_sent`` is every row moved, ``rows_dropped`` every live id
    lost because its owner shard had too few rows (likewise for candidates).
    """

    tables: dict[str, TableRelocation] = field(default_factory=dict)

    @property
    def rows_dropped(self) -> int:
        """Live ids this rank's shards dropped, all tables."""
        return sum(t.rows_dropped for t in self.tables.values())

    @property
    def candidates_dropped(self) -> int:
        """Candidates this rank's shards dropped, all tables."""
        return sum(t.candidates_dropped for t in self.tables.values())


@dataclass
class _Outgoing:
    """One table's records leaving this rank, grouped by destination rank (ascending)."""

    row_slots: torch.Tensor  # the rows they leave
    rows: torch.Tensor  # uint8 [n, R]
    row_counts: list[int]  # per destination rank
    candidates: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, _CANDIDATE_BYTES, dtype=torch.uint8)
    )
    candidate_counts: list[int] = field(default_factory=list)
    candidate_slots: torch.Tensor | None = None


def _row_fields(shard: ShardRows) -> list[torch.Tensor]:
    """The tensors indexed by row that travel with an id, in record order (ids first)."""
    idmap = shard.idmap
    fields = [idmap.buffer(n) for n in ("row_ids", "last_seen", "frequency")] + [shard.weight]
    return fields + row_states(shard.optimizer, shard.states)


def _candidate_fields(idmap: IdMap) -> list[torch.Tensor]:
    """The candidate table's tensors, in record order (ids first)."""
    return [idmap.buffer(n) for n in ("candidate_ids", "candidate_count", "candidate_last_seen")]


def _width(tensor: torch.Tensor) -> int:
    """Bytes one row of ``tensor`` takes."""
    return tensor.element_size() * math.prod(tensor.shape[1:])


def _encode(fields: Sequence[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``fields`` as one uint8 record per row, ``[len(index), R]``, on the
    host (bit-exact: the bytes of each value; the fields may live on different devices)."""
    n = index.numel()
    widths = [_width(f) for f in fields]
    records = torch.empty((n, sum(widths)), dtype=torch.uint8)
    start = 0
    for f, width in zip(fields, widths, strict=True):  # one field's copy at a time
        part = f.detach()[index.to(f.device)].cpu().reshape(n, math.prod(f.shape[1:]))
        records[:, start : start + width] = part.view(torch.uint8)
        start += width
    return records


def _decode(records: torch.Tensor, fields: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Records made by `_encode` of tensors shaped like ``fields``, back as tensors."""
    out, start, n = [], 0, records.shape[0]
    for f in fields:
        width = _width(f)
        # A fresh copy: aligned for the dtype's view (a slice's strides and offset are not).
        part = records[:, start : start + width].clone(memory_format=torch.contiguous_format)
        part = part.view(f.dtype)
        out.append(part.reshape(n, *f.shape[1:]))
        start += width
    return out


def _check(
    name: str, shard_ranks: Sequence[int], shard: ShardRows | None, rank: int, world: int
) -> None:
    """A table's entry is consistent with this rank (each rank checks its own, before any
    collective; the ranks list is the same everywhere)."""
    if len(set(shard_ranks)) != len(shard_ranks) or not all(0 <= r < world for r in shard_ranks):
        raise ValueError(
            f"table {name!r}: shard ranks {list(shard_ranks)} must be distinct ranks in "
            f"0..{world - 1}, one per row shard"
        )
    if shard is None:
        if rank in shard_ranks:
            raise ValueError(
                f"table {name!r}: rank {rank} holds row shard {shard_ranks.index(rank)} "
                "(shard ranks) but passed no ShardRows; pass its shard"
            )
        return
    expected = shard_ranks.index(rank) if rank in shard_ranks else None
    if shard.index != expected:
        raise ValueError(
            f"table {name!r}: rank {rank} passed row shard {shard.index}, but the shard ranks "
            f"{list(shard_ranks)} give it {expected}; pass the shard index of this rank"
        )
    if shard.weight.shape[0] != shard.idmap.num_rows:
        raise ValueError(
            f"table {name!r}: the shard's weight has {shard.weight.shape[0]} rows but its map "
            f"{shard.idmap.num_rows}; pass the weight view of the same row shard"
        )


def _outgoing(shard: ShardRows, shard_ranks: Sequence[int], world: int) -> _Outgoing:
    """Encode the live rows and candidates routed to another shard (freed once sent: a
    failed exchange loses nothing here)."""
    idmap = shard.idmap
    row_ids = idmap.buffer("row_ids")
    dest_rank = torch.tensor(list(shard_ranks), dtype=torch.int64, device=row_ids.device)
    slots = idmap.live().nonzero().squeeze(1)
    rows, row_counts = _leaving(row_ids, slots, dest_rank, shard.index, world)
    out = _Outgoing(rows, _encode(_row_fields(shard), rows), row_counts)
    out.candidates = torch.zeros((0, _CANDIDATE_BYTES), dtype=torch.uint8)
    out.candidate_counts = [0] * world
    if idmap.admit_after > 1:
        ids, used = idmap.buffer("candidate_ids"), idmap.buffer("candidate_used")
        live = used.nonzero().squeeze(1)
        gone, out.candidate_counts = _leaving(ids, live, dest_rank, shard.index, world)
        out.candidate_slots = gone
        out.candidates = _encode(_candidate_fields(idmap), gone)
    return out


def _free_sent(idmap: IdMap, out: _Outgoing) -> None:
    """Free the rows and candidate slots whose ids were sent away (id -1)."""
    with torch.no_grad():
        idmap.buffer("occupied")[out.row_slots] = False
        idmap.buffer("row_ids")[out.row_slots] = -1
        if out.candidate_slots is not None:
            idmap.buffer("candidate_used")[out.candidate_slots] = False
            idmap.buffer("candidate_ids")[out.candidate_slots] = -1


def _leaving(
    ids: torch.Tensor, slots: torch.Tensor, dest_rank: torch.Tensor, own: int, world: int
) -> tuple[torch.Tensor, list[int]]:
    """Of ``slots`` (ascending), those whose id routes to another shard, sorted by their
    owner's rank (stably), and how many go to each rank."""
    shard_of = route_shard(ids[slots], dest_rank.numel())
    away = shard_of != own
    slots, rank_of = slots[away], dest_rank[shard_of[away]]
    order = torch.sort(rank_of, stable=True).indices
    counts = torch.bincount(rank_of, minlength=world)
    return slots[order], [int(c) for c in counts]


def relocate(
    tables: Sequence[tuple[str, list[int], ShardRows | None]],
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta,
) -> RelocationReport:
    """Move every live id (and candidate) of sharded id-mapped tables to the shard it routes to.

    Collective: every rank of ``group`` calls it with the same tables in the same order. A
    live row whose id `route_shard` gives to another shard travels there with its id,
    ``last_seen``, ``frequency``, weight row and per-row / per-element optimizer state, and is
    freed here; the owner puts arrivals in its free rows, lowest first, in source-rank order.
    When more ids belong to a shard than it has rows, it keeps the ones its policy ranks
    highest (residents and arrivals together: the inverse of `IdMap.eviction_order`) and
    frees the rest; candidates likewise, the most recently seen kept. A row past the map's
    ``ttl_steps`` holds no live id: it stays, and arrivals may take it. Ids are taken to be
    unique over the shards of a table (as a saved map's are). Nothing to move changes nothing.

    Args:
        tables: per table, ``(name, the group rank of each row shard in shard order, this
            rank's shard or None when it holds none)``.
        group: the ranks holding the shards (None: the default group).
        timeout: limit of each of the two all-to-alls.

    Returns:
        This rank's counts per table; a warning names each table whose shard here dropped ids.

    Raises:
        ValueError: a table's shard ranks or this rank's shard do not fit together.
        RuntimeError: a collective timed out, or two shards of a table disagree on the row
            record (width or dtypes).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for name, shard_ranks, shard in tables:
        _check(name, shard_ranks, shard, rank, world)
    outgoing = [None if s is None else _outgoing(s, r, world) for _, r, s in tables]
    header_W = _header(outgoing, world)
    # Packed on the host, exchanged on a device the group serves (a CUDA-only group: the GPU).
    device = comm.collective_device(group, torch.device("cpu"))
    received_W, work = comm.start_all_to_all_counts(header_W.to(device), group)
    comm.wait(work, timeout)
    received_W = received_W.cpu()
    send, send_splits = _pack(outgoing, world)
    recv_splits = _recv_splits(received_W, outgoing, tables)
    payload, work = comm.start_all_to_all_flat(send.to(device), send_splits, recv_splits, group)
    comm.wait(work, timeout)
    return _unpack(tables, outgoing, received_W, payload.cpu())


def relocate_in_process(
    ranks_tables: Sequence[Sequence[tuple[str, list[int], ShardRows | None]]],
) -> list[RelocationReport]:
    """`relocate` with every rank's shards in this process, no process group: what each rank
    would send is sliced out and handed to its destination instead of exchanged, so the
    records, the placement, the reports and their warnings are `relocate`'s own (offline,
    `recopt-reshard` places a checkpoint's ids for its target plan with it).

    Args:
        ranks_tables: per rank of the target world, its ``tables`` argument of `relocate`.

    Returns:
        Each rank's report.

    Raises:
        ValueError, RuntimeError: as `relocate`.
    """
    world = len(ranks_tables)
    for rank, tables in enumerate(ranks_tables):
        for name, shard_ranks, shard in tables:
            _check(name, shard_ranks, shard, rank, world)
    outgoing = [
        [None if s is None else _outgoing(s, r, world) for _, r, s in tables]
        for tables in ranks_tables
    ]
    headers = [_header(out, world) for out in outgoing]
    reports = []
    for d, tables in enumerate(ranks_tables):
        received_W = torch.stack([header_W[d] for header_W in headers])
        _recv_splits(received_W, outgoing[d], tables)  # the width check `relocate` makes
        # Rank d's receive buffer: what each source sends it, in source-rank order.
        pieces = [p for out in outgoing for p in _pieces_for(out, d)]
        payload = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
        reports.append(_unpack(tables, outgoing[d], received_W, payload))
    return reports


def _header(outgoing: Sequence[_Outgoing | None], world: int) -> torch.Tensor:
    """``[W, 3T]``: what this rank tells each rank of each table (rows, candidates, width)."""
    header_W = torch.zeros((world, _HEADER * len(outgoing)), dtype=torch.int64)
    for t, out in enumerate(outgoing):
        if out is not None:
            header_W[:, _HEADER * t] = torch.tensor(out.row_counts)
            header_W[:, _HEADER * t + 1] = torch.tensor(out.candidate_counts)
            header_W[:, _HEADER * t + 2] = out.rows.shape[1]
    return header_W


def _pack(outgoing: Sequence[_Outgoing | None], world: int) -> tuple[torch.Tensor, list[int]]:
    """The send buffer: for each destination rank, each table's rows then candidates."""
    pieces = [_pieces_for(outgoing, d) for d in range(world)]
    splits = [sum(p.numel() for p in per_rank) for per_rank in pieces]
    parts = [p for per_rank in pieces for p in per_rank]
    send = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return send, splits


def _pieces_for(outgoing: Sequence[_Outgoing | None], d: int) -> list[torch.Tensor]:
    """What this rank sends rank ``d``, as views: each table's rows then its candidates."""
    pieces = []
    for out in outgoing:
        if out is None:
            continue
        r0, c0 = sum(out.row_counts[:d]), sum(out.candidate_counts[:d])
        pieces.append(out.rows[r0 : r0 + out.row_counts[d]].reshape(-1))
        pieces.append(out.candidates[c0 : c0 + out.candidate_counts[d]].reshape(-1))
    return pieces


def _recv_splits(
    received_W: torch.Tensor,
    outgoing: Sequence[_Outgoing | None],
    tables: Sequence[tuple[str, list[int], ShardRows | None]],
) -> list[int]:
    """Bytes arriving from each rank; a source's row record must match this shard's."""
    splits = []
    for s in range(received_W.shape[0]):
        total = 0
        for t, (name, _, shard) in enumerate(tables):
            n, c, width = received_W[s, _HEADER * t : _HEADER * t + _HEADER].tolist()
            if n == 0 and c == 0:
                continue
            own = outgoing[t]
            if shard is None or own is None or own.rows.shape[1] != width:
                mine = None if own is None else own.rows.shape[1]
                raise RuntimeError(
                    f"table {name!r}: rank {s} sends rows of {width} bytes to this rank, whose "
                    f"shard's rows take {mine}; every shard of a table must have the same "
                    "width, weight dtype and optimizer"
                )
            total += n * width + c * _CANDIDATE_BYTES
        splits.append(total)
    return splits


def _unpack(
    tables: Sequence[tuple[str, list[int], ShardRows | None]],
    outgoing: Sequence[_Outgoing | None],
    received_W: torch.Tensor,
    payload: torch.Tensor,
) -> RelocationReport:
    """Split the arrivals by table and place them; the report and its warnings."""
    arrivals: list[list[torch.Tensor]] = [[] for _ in tables]
    candidates: list[list[torch.Tensor]] = [[] for _ in tables]
    start = 0
    for s in range(received_W.shape[0]):
        for t, out in enumerate(outgoing):
            n, c, width = received_W[s, _HEADER * t : _HEADER * t + _HEADER].tolist()
            if out is None or (n == 0 and c == 0):
                continue
            arrivals[t].append(payload[start : start + n * width].view(n, width))
            start += n * width
            size = c * _CANDIDATE_BYTES
            candidates[t].append(payload[start : start + size].view(c, _CANDIDATE_BYTES))
            start += size
    report = RelocationReport()
    for t, (name, _, shard) in enumerate(tables):
        done = report.tables.setdefault(name, TableRelocation())
        out = outgoing[t]
        if shard is None or out is None:
            continue
        done.rows_sent, done.candidates_sent = out.rows.shape[0], out.candidates.shape[0]
        _free_sent(shard.idmap, out)
        _place_table(shard, arrivals[t], candidates[t], done)
        if any(vars(done).values()):
            shard.idmap.buffers_changed()
        if done.rows_dropped or done.candidates_dropped:
            logger.warning(
                "id-map relocation: table %r row shard %d dropped %d live id(s) and %d "
                "candidate(s): more ids route to it than it has rows (kept by policy %r)",
                name,
                shard.index,
                done.rows_dropped,
                done.candidates_dropped,
                shard.idmap.config.policy,
            )
    return report


def _place_table(
    shard: ShardRows,
    arrivals: list[torch.Tensor],
    candidates: list[torch.Tensor],
    done: TableRelocation,
) -> None:
    """Put one table's arriving rows and candidates into this shard."""
    idmap = shard.idmap
    row_ids = idmap.buffer("row_ids")
    if arrivals:
        fields = _row_fields(shard)
        incoming = _decode(torch.cat(arrivals).to(row_ids.device), fields)
        live = idmap.live()
        residents = live.nonzero().squeeze(1)
        last_seen = torch.cat([idmap.buffer("last_seen")[residents], incoming[1]])
        frequency = torch.cat([idmap.buffer("frequency")[residents], incoming[2]])
        order = policy_eviction_order(idmap.config, idmap.buffer("step"), last_seen, frequency)
        done.rows_received = incoming[0].shape[0]
        done.rows_dropped = _place(idmap.buffer("occupied"), live, fields, incoming, order)
    if candidates and idmap.admit_after > 1:
        fields = _candidate_fields(idmap)
        incoming = _decode(torch.cat(candidates).to(row_ids.device), fields)
        residents = idmap.buffer("candidate_used").nonzero().squeeze(1)
        last_seen = torch.cat([idmap.buffer("candidate_last_seen")[residents], incoming[2]])
        order = torch.sort(last_seen, stable=True).indices
        done.candidates_received = incoming[0].shape[0]
        used = idmap.buffer("candidate_used")
        done.candidates_dropped = _place(used, used.clone(), fields, incoming, order)


def _place(
    used: torch.Tensor,
    live: torch.Tensor,
    fields: list[torch.Tensor],
    incoming: list[torch.Tensor],
    order: torch.Tensor,
) -> int:
    """Write arrivals (``incoming``: values of ``fields``, ids first) into the slots that are
    not ``live``, lowest first, and mark them ``used``. Over capacity, the first of ``order``
    (positions over the live residents, ascending, then the arrivals) go: residents' slots
    are freed (id -1), arrivals are not placed. Returns how many ids went."""
    count = incoming[0].shape[0]
    keep = torch.ones(count, dtype=torch.bool, device=used.device)
    residents = live.nonzero().squeeze(1)
    need = residents.numel() + count - live.numel()
    with torch.no_grad():
        if need > 0:
            gone = order[:need]
            evicted = residents[gone[gone < residents.numel()]]
            used[evicted], live[evicted] = False, False
            fields[0][evicted] = -1
            keep[gone[gone >= residents.numel()] - residents.numel()] = False
        slots = (~live).nonzero().squeeze(1)[: int(keep.sum())]
        for target, values in zip(fields, incoming, strict=True):  # a weight may live elsewhere
            target[slots.to(target.device)] = values[keep].to(target.device)
        used[slots] = True
    return max(need, 0)
