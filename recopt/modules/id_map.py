"""Id maps: raw int64 ids of an unbounded space mapped to a table's rows without collisions.

One `IdMap` per id-mapped table holds, as tensors, each row's raw id, when it was last seen and
how often (decayed), plus an optional table of admission candidates. `IdMap.remap` turns a
batch's raw ids into rows in torch ops: known ids keep their row, new ids take free rows, and
when the table is full the policy (``lru`` / ``lfu``) evicts rows not used by the batch.
Legend: N rows, U distinct ids of a batch, M ids of a batch, C candidate slots.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from recopt.kernels import cpu_id_map
from recopt.modules.id_map_native import NativeIdMap
from recopt.modules.id_map_results import (
    CANDIDATE_BUFFERS,
    ROW_BUFFERS,
    MapUndo,
    Remapped,
    RemapStats,
)

__all__ = [
    "CANDIDATE_BUFFERS",
    "ROW_BUFFERS",
    "IdMap",
    "IdMapConfig",
    "MapUndo",
    "RemapStats",
    "Remapped",
    "decay_powers",
    "map_device",
    "policy_eviction_order",
]

POLICIES = ("lru", "lfu")
DEFAULT_LFU_DECAY = 0.99


@dataclass(frozen=True, kw_only=True, slots=True)
class IdMapConfig:
    """How an id-mapped table gives rows to raw ids (``EmbeddingBagConfig.id_map``).

    With it a table takes any int64 id: each distinct id gets its own row while there is room
    (``num_embeddings`` rows); when a batch brings new ids to a full table, rows not used by
    the batch are evicted by ``policy``. An evicted or freed row is re-initialised (the table's
    init) and, in the fused collections, its optimizer state zeroed before its new id uses it.

    Args:
        policy: ``"lru"`` evicts the row least recently seen; ``"lfu"`` the row seen least
            often, its count multiplied by ``decay`` every step (ties: least recently seen,
            then the lowest row).
        decay: ``lfu`` only: per-step decay of the counts, in ``(0, 1]``; default 0.99
            (1.0 counts forever).
        ttl_steps: ids unseen for more than this many training steps lose their row (it is
            free for new ids; the id, seen again, gets a fresh row).
        admit_after: an id gets a row only once seen this many times (occurrences, over
            training batches); before that it reads a shared zero row that is never
            trained. ``None`` or 1: at once.
        candidate_slots: how many not-yet-admitted ids are counted (default
            ``num_embeddings``); when full, the least recently seen candidate is forgotten.

    Example (TOML, on a table): ``id_map = { policy = "lfu", decay = 0.95, admit_after = 2 }``
    """

    policy: str = "lru"
    decay: float | None = None
    ttl_steps: int | None = None
    admit_after: int | None = None
    candidate_slots: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"id_map.policy {self.policy!r} is not a policy; use one of {list(POLICIES)}"
            )
        if self.decay is not None:
            if self.policy != "lfu":
                raise ValueError(
                    f"id_map.decay {self.decay!r} applies to policy 'lfu' only; drop it or "
                    "set policy = 'lfu'"
                )
            if isinstance(self.decay, bool) or not 0.0 < float(self.decay) <= 1.0:
                raise ValueError(f"id_map.decay must be in (0, 1], got {self.decay!r}; e.g. 0.99")
        for name in ("ttl_steps", "admit_after", "candidate_slots"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"id_map.{name} must be an int >= 1 or unset, got {value!r}")
        if self.candidate_slots is not None and (self.admit_after or 1) <= 1:
            raise ValueError(
                f"id_map.candidate_slots {self.candidate_slots} needs admit_after >= 2 "
                "(candidates are ids waiting for admission); drop it or set admit_after"
            )

    @property
    def lfu_decay(self) -> float:
        """The per-step decay of the ``lfu`` counts (1.0 under ``lru``: plain counts)."""
        if self.policy != "lfu":
            return 1.0
        return DEFAULT_LFU_DECAY if self.decay is None else float(self.decay)


def decay_powers(decay: float, ages: torch.Tensor) -> torch.Tensor:
    """``decay ** ages`` (float64) for lfu's counts, as a product of fixed factors.

    Each age's power is the product of ``decay^(2^b)`` (by repeated squaring) over the set
    bits ``b`` of the age, lowest bit first; ages below 0 count as 0. A fixed sequence of
    float64 products rounds the same on every device and kernel, and the native maps
    (`recopt.kernels.cpu_id_map.decay_powers`) compute the same sequence, so the maps agree
    bit for bit wherever they run. ``torch.pow`` would not: its vectorised and scalar CPU
    kernels, and CUDA's, may differ in the last bit, which can reorder near ties.
    """
    out = torch.ones(ages.shape, dtype=torch.float64, device=ages.device)
    if decay == 1.0 or ages.numel() == 0:
        return out
    ages = ages.to(torch.int64).clamp(min=0)
    square = float(decay)
    for bit in range(int(ages.max()).bit_length()):
        out = torch.where((ages >> bit) & 1 == 1, out * square, out)
        square *= square
    return out


def lfu_order(last_seen: torch.Tensor, decayed: torch.Tensor) -> torch.Tensor:
    """Positions of entries in lfu's eviction order: the lowest decayed count first, ties to
    the least recently seen, then by position (sorted by recency, then stably by count)."""
    by_recency = torch.sort(last_seen, stable=True).indices
    return by_recency[torch.sort(decayed[by_recency], stable=True).indices]


def policy_eviction_order(
    config: IdMapConfig, step: torch.Tensor, last_seen: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """Positions of the entries (``last_seen``, ``frequency``: one per id, at map step
    ``step``) in ``config.policy``'s eviction order, the first to go first; ties by position.

    `IdMap.eviction_order` over a map's rows; also over ids that are not in one map yet (ids
    arriving at a row shard: `recopt.sharding.id_map_relocate`).
    """
    if config.policy == "lru":
        return torch.sort(last_seen, stable=True).indices
    return lfu_order(last_seen, frequency * decay_powers(config.lfu_decay, step - last_seen))


def map_device(device: torch.device | str | None) -> torch.device:
    """Where the map of a table on ``device`` lives: the table's device, except that a CUDA
    table's map is kept in host memory when the native remap is there. On CUDA the torch
    ops' remap is bound by kernel launches and host reads (26 maps of 2048 ids: 44-76 ms on
    an H200 against a 3.3 ms fused step; benchmarks/README.md, "Id maps on CUDA"); the
    native remap on the host, with the ids copied over and the rows back, is far cheaper."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and IdMap.native and cpu_id_map.available():
        return torch.device("cpu")
    return device


class IdMap(nn.Module):
    """The map of one table: raw id -> row, with the policy's counters (all buffers).

    Buffers (in the module's state_dict): ``row_ids`` [N] (the raw id of each row, -1 where
    free: check ``occupied``), ``occupied`` [N] bool, ``last_seen`` [N] (step), ``frequency``
    [N] float64 (count, decayed to ``last_seen`` under lfu), ``step`` (training batches
    seen); with admission also ``candidate_ids``/``candidate_used``/``candidate_count``/
    ``candidate_last_seen`` [C].

    Args:
        config: the table's `IdMapConfig`.
        num_rows: the table's ``num_embeddings``.
        device: where the map lives (the table's device).

    On CPU the remap runs in native code (`recopt/modules/id_map_native.py`: the same
    results, O(batch) work a step) when a C compiler is there; ``native = False`` (on the
    class or an instance) keeps the torch ops, the reference (and the path of a map on CUDA).
    The ids may live elsewhere than the map: a CUDA table's map is kept in host memory
    (``on_host``, `map_device`), where `remap` copies its ids and returns the rows on their
    device.
    """

    native: bool = True
    on_host: bool = False  # kept in host memory: `.to(device)` and the like leave it there

    def __init__(
        self, config: IdMapConfig, num_rows: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.num_rows = num_rows
        self._register_slots("", num_rows, device)
        self.register_buffer("frequency", torch.zeros(num_rows, dtype=torch.float64, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.admit_after = config.admit_after or 1
        if self.admit_after > 1:
            slots = config.candidate_slots or num_rows
            self._register_slots("candidate_", slots, device)
            self.register_buffer(
                "candidate_count", torch.zeros(slots, dtype=torch.int64, device=device)
            )
        self._index: dict[str, tuple[tuple[int, int], torch.Tensor, torch.Tensor]] = {}
        self._native_map: NativeIdMap | None = None
        self.last_stats = RemapStats()
        self.register_load_state_dict_post_hook(_loaded_stats)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> IdMap:
        """`nn.Module.to` and its kin, except on a map kept on the host (``on_host``): a
        CUDA table's map stays in host memory, where its remap runs (`map_device`), and its
        int64 and float64 counters keep their dtype."""
        if self.on_host:
            return self
        super()._apply(fn, recurse)
        return self

    def _register_slots(self, prefix: str, size: int, device: torch.device | str | None) -> None:
        ids_name = "row_ids" if not prefix else f"{prefix}ids"
        occupied_name = "occupied" if not prefix else f"{prefix}used"
        self.register_buffer(ids_name, torch.full((size,), -1, dtype=torch.int64, device=device))
        self.register_buffer(occupied_name, torch.zeros(size, dtype=torch.bool, device=device))
        self.register_buffer(
            f"{prefix}last_seen" if prefix else "last_seen",
            torch.full((size,), -1, dtype=torch.int64, device=device),
        )

    def buffer(self, name: str) -> torch.Tensor:
        """The buffer ``name`` (``row_ids``, ``last_seen``, ...), typed."""
        value = getattr(self, name)
        assert isinstance(value, torch.Tensor)
        return value

    def _find(self, which: str, ids_U: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``ids_U`` in the row (``which`` "") or candidate table, or -1.

        A sorted copy of the live ids is kept between batches; it is rebuilt when the ids or
        the occupancy changed in place (a remap, a state_dict load, a checkpoint's copy),
        which torch's version counters of those buffers tell.
        """
        ids = self.buffer("row_ids" if not which else "candidate_ids")
        used = self.buffer("occupied" if not which else "candidate_used")
        stamp = (ids._version, used._version)
        cached = self._index.get(which)
        if cached is None or cached[0] != stamp:
            slots = used.nonzero().squeeze(1)
            keys, order = torch.sort(ids[slots])
            cached = (stamp, keys, slots[order])
            self._index[which] = cached
        _, keys, slots = cached
        if keys.numel() == 0:
            return torch.full_like(ids_U, -1)
        pos = torch.searchsorted(keys, ids_U).clamp(max=keys.numel() - 1)
        return torch.where(keys[pos] == ids_U, slots[pos], torch.full_like(ids_U, -1))

    def occupancy(self) -> float:
        """Live rows / rows (rows past ``ttl_steps`` count as free)."""
        return float(self.live().sum()) / self.num_rows

    def live(self) -> torch.Tensor:
        """``[N]`` bool, a new tensor: the rows holding a live id (occupied and, with
        ``ttl_steps``, not expired: an expired row is free)."""
        live = self.buffer("occupied").clone()
        ttl = self.config.ttl_steps
        if ttl is not None:
            live &= self.buffer("step") - self.buffer("last_seen") <= ttl
        return live

    def remap(self, ids_M: torch.Tensor, training: bool, record_undo: bool = False) -> Remapped:
        """Rows for a batch of raw ids; in training, new ids get rows and counters move.

        Outside training (``training=False``) nothing changes: unknown (or expired) ids read
        the zero row (-1).

        Args:
            ids_M: raw int64 ids, any values.
            training: update the map (one step) or only read it.
            record_undo: in training, also return in ``Remapped.undo`` a `MapUndo` that
                `apply_undo` uses to put the map back as it was before this call.

        Returns:
            `Remapped`: a row per id (-1 for the zero row) and the rows given to new ids.
        """
        ids_M = ids_M.to(torch.int64)
        home = self.buffer("occupied").device
        if ids_M.device != home:  # a host map of a CUDA table: the ids come over, rows go back
            return self.remap(ids_M.to(home), training, record_undo).to(ids_M.device)
        native = self._native()
        if native is not None:
            return native.train(self, ids_M, record_undo) if training else native.read(self, ids_M)
        if not (training and record_undo):
            return self._remap(ids_M, training)
        before = {name: self.buffer(name).clone() for name in self._undo_buffers()}
        step, stats = int(self.buffer("step")), copy.copy(self.last_stats)
        result = self._remap(ids_M, training)
        result.undo = self._changes(before, step, stats)
        return result

    def _native(self) -> NativeIdMap | None:
        """The native remap's cache (created at first use), or None: torch ops then."""
        occupied = self._buffers["occupied"]  # no nn.Module attribute lookup: a hot path
        if not self.native or occupied is None or not occupied.is_cpu:
            return None
        if self._native_map is None:
            if not cpu_id_map.available():
                return None
            slots = self.buffer("candidate_ids").numel() if self.admit_after > 1 else 0
            self._native_map = NativeIdMap(self.num_rows, slots, self.config.lfu_decay)
        return self._native_map

    def forget_index(self) -> None:
        """Drop the torch path's sorted index of live ids (after writes that kept the
        buffers' version counters: the native remap's)."""
        self._index.clear()

    def native_stepped(self, stats: RemapStats) -> None:
        """Record a native step: its stats, and the torch path's index dropped (the native
        writes kept the version counters). A plain attribute write: `nn.Module.__setattr__`
        costs microseconds a table, and ``last_stats`` is no parameter, buffer or module."""
        self.__dict__["last_stats"] = stats
        self._index.clear()

    def buffers_changed(self) -> None:
        """Say that the buffers were written where torch's version counters do not see it
        (a raw pointer, a collective receiving into them): the caches derived from them (the
        torch path's sorted index, the native hash table) are rebuilt at the next remap.
        Writes through torch ops (``copy_``, ``load_state_dict``, indexing) need no call."""
        self._index.clear()
        if self._native_map is not None:
            self._native_map.invalidate()

    def loaded(self) -> None:
        """After a load: ``last_stats`` says the loaded step and occupancy (the counts of the
        step that made them are not saved: zero)."""
        stats = RemapStats(int(self.buffer("step")), self.occupancy())
        self.__dict__["last_stats"] = stats

    def _undo_buffers(self) -> tuple[str, ...]:
        return ROW_BUFFERS + (CANDIDATE_BUFFERS if self.admit_after > 1 else ())

    def _changes(self, before: dict[str, torch.Tensor], step: int, stats: RemapStats) -> MapUndo:
        """The `MapUndo` of the slots whose buffers differ from ``before`` (bitwise)."""

        def changed(names: tuple[str, ...]) -> torch.Tensor:
            mask = torch.zeros_like(before[names[0]], dtype=torch.bool)
            for name in names:
                old, new = before[name], self.buffer(name)
                if old.dtype == torch.float64:  # bitwise: -0.0 and 0.0 differ
                    old, new = old.view(torch.int64), new.view(torch.int64)
                mask |= old != new
            return mask.nonzero().squeeze(1)

        rows = changed(ROW_BUFFERS)
        undo = MapUndo(step, stats, rows, {n: before[n][rows] for n in ROW_BUFFERS}, rows[:0])
        if self.admit_after > 1:
            slots = changed(CANDIDATE_BUFFERS)
            undo.candidate_slots = slots
            undo.candidate_values = {n: before[n][slots] for n in CANDIDATE_BUFFERS}
        return undo

    def apply_undo(self, undo: MapUndo) -> None:
        """Put the map back as it was before the remap that recorded ``undo`` (bit-exact).

        Undo the remaps in reverse order (the last one first) to go back several steps.
        """
        names = ("step", *self._undo_buffers())
        undo.write_into({name: self.buffer(name) for name in names})
        self.last_stats = copy.copy(undo.stats)

    def _remap(self, ids_M: torch.Tensor, training: bool) -> Remapped:
        empty = ids_M.new_empty(0)
        if ids_M.numel() == 0 and not training:
            return Remapped(torch.full_like(ids_M, -1), empty, empty)
        ids_U, inverse_M, counts_U = torch.unique(
            ids_M, sorted=True, return_inverse=True, return_counts=True
        )
        slot_U = self._find("", ids_U)
        ttl = self.config.ttl_steps
        if not training:
            if ttl is not None:
                stale = self.buffer("step") - self.buffer("last_seen")[slot_U.clamp(min=0)] > ttl
                slot_U = torch.where(stale, torch.full_like(slot_U, -1), slot_U)
            return Remapped(slot_U[inverse_M], empty, empty)
        self.buffer("step").add_(1)
        return self._train_step(ids_U, inverse_M, counts_U, slot_U)

    def _train_step(
        self,
        ids_U: torch.Tensor,
        inverse_M: torch.Tensor,
        counts_U: torch.Tensor,
        slot_U: torch.Tensor,
    ) -> Remapped:
        step = self.buffer("step")
        stats = RemapStats(step=int(step))
        last_seen, occupied = self.buffer("last_seen"), self.buffer("occupied")
        if self.config.ttl_steps is not None:
            # Rows unseen past the ttl are free: an id found there starts over in a new row.
            expired_N = occupied & (step - last_seen > self.config.ttl_steps)
            stats.expired = int(expired_N.sum())
            if stats.expired:
                occupied &= ~expired_N
                self.buffer("row_ids")[expired_N] = -1
                slot_U = self._find("", ids_U)
        known_U = slot_U >= 0
        self._count_known(slot_U[known_U], counts_U[known_U])
        new_ids, new_counts = ids_U[~known_U], counts_U[~known_U]
        admitted = torch.ones_like(new_ids, dtype=torch.bool)
        if self.admit_after > 1 and new_ids.numel():
            admitted = self._admit(new_ids, new_counts)
            stats.admissions = int(admitted.sum())
        # Most frequent new ids first: when rows run short, they are the ones placed.
        order = torch.sort(new_counts[admitted], descending=True, stable=True).indices
        wanted_ids, wanted_counts = new_ids[admitted][order], new_counts[admitted][order]
        rows, stats.evictions = self._allocate(wanted_ids.numel(), slot_U[known_U])
        placed_ids = wanted_ids[: rows.numel()]
        self.buffer("row_ids")[rows] = placed_ids
        occupied[rows] = True
        last_seen[rows] = step
        self.buffer("frequency")[rows] = wanted_counts[: rows.numel()].to(torch.float64)
        stats.new_ids = rows.numel()
        slot_U = self._find("", ids_U) if rows.numel() else slot_U
        stats.zero_row_ids = int((slot_U < 0).sum())
        stats.occupancy = float(occupied.sum()) / self.num_rows
        self.last_stats = stats
        return Remapped(slot_U[inverse_M], rows, placed_ids, stats)

    def _count_known(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Known ids were seen: last_seen moves to now, frequency decays to now and adds."""
        step, last_seen = self.buffer("step"), self.buffer("last_seen")
        frequency = self.buffer("frequency")
        decay = self.config.lfu_decay
        kept = frequency[rows]
        if decay != 1.0:
            kept = kept * decay_powers(decay, step - last_seen[rows])
        frequency[rows] = kept + counts.to(torch.float64)
        last_seen[rows] = step

    def _allocate(self, count: int, protected: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``count`` rows for new ids (fewer if the batch uses every row) and the evictions.

        Free rows first (lowest first); then live rows not used by this batch, the first in
        the policy's order (lru: in that order; lfu: the lowest decayed counts, in row order,
        which spares the native remap a sort of its victims). Evicted ids leave the map
        (their rows are the caller's to reset).
        """
        occupied = self.buffer("occupied")
        free = (~occupied).nonzero().squeeze(1)[:count]
        need = count - free.numel()
        if need <= 0:
            return free, 0
        evictable = occupied.clone()
        evictable[protected] = False
        rows = evictable.nonzero().squeeze(1)
        victims = rows[self.eviction_order(rows)[:need]]
        if self.config.policy == "lfu":  # lfu's go to the new ids in row order
            victims = victims.sort().values
        occupied[victims] = False
        self.buffer("row_ids")[victims] = -1
        return torch.cat([free, victims]), victims.numel()

    def eviction_order(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions of ``rows`` (ascending) in eviction order: the policy's, ties by row."""
        return policy_eviction_order(
            self.config,
            self.buffer("step"),
            self.buffer("last_seen")[rows],
            self.buffer("frequency")[rows],
        )

    def _admit(self, new_ids: torch.Tensor, new_counts: torch.Tensor) -> torch.Tensor:
        """Count ``new_ids`` as candidates; True where an id reaches ``admit_after`` now."""
        step = self.buffer("step")
        slot = self._find("candidate_", new_ids)
        count_C = self.buffer("candidate_count")
        total = new_counts + torch.where(slot >= 0, count_C[slot.clamp(min=0)], 0)
        admitted = total >= self.admit_after
        used, cand_ids = self.buffer("candidate_used"), self.buffer("candidate_ids")
        cand_seen = self.buffer("candidate_last_seen")
        gone = slot[admitted & (slot >= 0)]
        used[gone] = False  # admitted ids leave the candidates
        waiting = ~admitted
        known = waiting & (slot >= 0)
        count_C[slot[known]] = total[known]
        cand_seen[slot[known]] = step
        fresh = waiting & (slot < 0)
        seen_now = slot[known]
        spare = (~used).nonzero().squeeze(1)
        need = int(fresh.sum()) - spare.numel()
        if need > 0:  # forget the least recently seen candidates not seen in this batch
            old = used.clone()
            old[seen_now] = False
            rows = old.nonzero().squeeze(1)
            forget = rows[torch.sort(cand_seen[rows], stable=True).indices[:need]]
            used[forget] = False
            spare = torch.cat([spare, forget])
        spare = spare[: int(fresh.sum())]
        placed = fresh.nonzero().squeeze(1)[: spare.numel()]
        cand_ids[spare] = new_ids[placed]
        count_C[spare] = total[placed]
        cand_seen[spare] = step
        used[spare] = True
        return admitted


def _loaded_stats(module: nn.Module, incompatible_keys: object) -> None:
    """load_state_dict post-hook of `IdMap` (`IdMap.loaded`)."""
    assert isinstance(module, IdMap)
    module.loaded()
