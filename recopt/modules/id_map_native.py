"""The remap of an `IdMap` on CPU in native code (recopt/kernels/cpu_id_map.c): O(batch) a step.

The map's state stays in the `IdMap`'s buffers (the native side writes them in place); the
native side only adds a cache derived from them (hash table id -> row, recency list, free-row
heap), rebuilt when the buffers changed elsewhere, which their torch version counters and
data pointers tell (native writes leave the counters alone). It gives exactly the torch
path's results: lfu's float64 decay powers (of the batch's known rows) and lfu's victims
(only on steps that evict) are computed by the torch path's own ops, over a cached set of
low-count rows (`LowSet`) where it proves the answer, else over every row.
Legend: M ids of a batch, K known rows, N rows.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from recopt.kernels import cpu_id_map
from recopt.modules.id_map_results import (
    CANDIDATE_BUFFERS,
    ROW_BUFFERS,
    MapUndo,
    Remapped,
    RemapStats,
)

if TYPE_CHECKING:
    from recopt.modules.id_map import IdMap

_Stamp = tuple[tuple[int, int], ...]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


class NativeIdMap:
    """The native cache of one `IdMap` (owned by it; see `IdMap.remap`).

    Args:
        num_rows: the map's rows.
        num_candidates: its candidate slots (0 without admission).

    Raises:
        MemoryError: the native side could not allocate its cache.
    """

    def __init__(self, num_rows: int, num_candidates: int) -> None:
        self._lib = cpu_id_map.library()
        self.num_rows, self.num_candidates = num_rows, num_candidates
        handle = self._lib.rim_new(num_rows, num_candidates)
        if not handle:
            raise MemoryError(f"id map: no memory for the native cache of {num_rows} rows")
        self._handle = ctypes.c_void_p(handle)
        self._stamp: _Stamp | None = None
        self._pointers: ctypes.Array[ctypes.c_void_p] | None = None
        self.low_set = LowSet()  # lfu's victims without a scan of every row (usually)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            self._lib.rim_free(handle)

    def __deepcopy__(self, memo: dict[int, object]) -> NativeIdMap:
        return NativeIdMap(self.num_rows, self.num_candidates)  # a fresh cache, rebuilt at use

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return NativeIdMap, (self.num_rows, self.num_candidates)

    def invalidate(self) -> None:
        """Rebuild the cache from the buffers at the next use (`IdMap.buffers_changed`)."""
        self._stamp = None

    def _sync(self, idmap: IdMap) -> ctypes.Array[ctypes.c_void_p]:
        """The buffers' pointers, after rebuilding the cache if they changed elsewhere."""
        names = ROW_BUFFERS + (CANDIDATE_BUFFERS if self.num_candidates else ())
        own = idmap._buffers  # the module's buffer table: no nn.Module attribute lookups
        buffers = [b for b in (own[name] for name in names) if b is not None]
        stamp = tuple((b.data_ptr(), b._version) for b in buffers)
        if stamp != self._stamp or self._pointers is None:
            assert len(buffers) == len(names) and all(b.is_contiguous() for b in buffers)
            self._pointers = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
            if self._lib.rim_rebuild(self._handle, self._pointers) != 0:
                raise MemoryError("id map: no memory to rebuild the native cache")
            self._stamp = stamp
            self.low_set.drop()  # the buffers changed elsewhere: the keys may have too
        return self._pointers

    def read(self, idmap: IdMap, ids_M: torch.Tensor) -> Remapped:
        """Outside training: the row of each id (-1: unknown or expired); nothing changes."""
        pointers = self._sync(idmap)
        ids_M = ids_M.contiguous()
        rows_M = torch.empty_like(ids_M)
        step = int(idmap.buffer("step"))
        ttl = idmap.config.ttl_steps or 0
        self._lib.rim_lookup(
            self._handle, pointers, _ptr(ids_M), ids_M.numel(), step, ttl, _ptr(rows_M)
        )
        empty = ids_M.new_empty(0)
        return Remapped(rows_M, empty, empty)

    def train(self, idmap: IdMap, ids_M: torch.Tensor, record_undo: bool) -> Remapped:
        """One training step of ``idmap`` on ``ids_M`` (as `IdMap.remap`)."""
        pointers = self._sync(idmap)
        ids_M = ids_M.contiguous()
        num_ids = ids_M.numel()
        step_t = idmap.buffer("step")
        old_step, old_stats = int(step_t), idmap.last_stats  # replaced, never mutated
        step_t.add_(1)
        step = old_step + 1
        known = torch.empty(max(num_ids, 1), dtype=torch.int64)
        num_known = self._lib.rim_begin(
            self._handle,
            pointers,
            _ptr(ids_M),
            num_ids,
            step,
            idmap.config.ttl_steps or 0,
            int(record_undo),
            _ptr(known),
        )
        if num_known < 0:
            raise MemoryError("id map: no memory for the native remap's scratch")
        known = known[:num_known]
        decay = idmap.config.lfu_decay
        factors = None
        if decay != 1.0 and num_known:  # the torch path's expression, on the same rows
            age = (step_t - idmap.buffer("last_seen")[known]).to(torch.float64)
            factors = decay**age
        info = (ctypes.c_int64 * 3)()
        self._lib.rim_middle(self._handle, pointers, step, _ptr(factors), idmap.admit_after, info)
        wanted, free, evictable = info
        victims = self._lfu_victims(idmap, known, wanted - free, evictable)
        rows_M = torch.empty_like(ids_M)
        fresh_rows = torch.empty(wanted, dtype=torch.int64)
        fresh_ids = torch.empty(wanted, dtype=torch.int64)
        out = (ctypes.c_int64 * 6)()
        status = self._lib.rim_finish(
            self._handle,
            pointers,
            step,
            _ptr(victims),
            0 if victims is None else victims.numel(),
            _ptr(rows_M),
            num_ids,
            _ptr(fresh_rows),
            _ptr(fresh_ids),
            out,
        )
        stats = _stepped(idmap, step, self.num_rows, list(out))
        placed = stats.new_ids
        if idmap.config.policy == "lfu":
            self.low_set.touched(known, fresh_rows[:placed])
        result = Remapped(rows_M, fresh_rows[:placed], fresh_ids[:placed], stats)
        if record_undo:
            if status != 0:
                raise MemoryError("id map: no memory for the undo record")
            result.undo = self._undo(old_step, old_stats)
        return result

    def _lfu_victims(
        self, idmap: IdMap, known: torch.Tensor, need: int, evictable: int
    ) -> torch.Tensor | None:
        """lfu's victims by the torch path's order (None under lru: the native list's head)."""
        if idmap.config.policy != "lfu" or need <= 0 or evictable <= 0:
            return None
        victims = self.low_set.victims(idmap, known, need)
        if victims is not None:
            return victims
        mask = idmap.buffer("occupied").clone()
        mask[known] = False
        rows = mask.nonzero().squeeze(1)
        victims = rows[eviction_head(idmap, rows, need)].contiguous()
        self.low_set.rebuild(idmap, rows, need)
        return victims

    def _undo(self, step: int, stats: RemapStats) -> MapUndo:
        """The last step's undo record, copied out of the native side."""

        def copy_out(which: int, float_values: bool) -> list[torch.Tensor]:
            size = int(self._lib.rim_undo_size(self._handle, which))
            slots, ids, seen = (torch.empty(size, dtype=torch.int64) for _ in range(3))
            used = torch.empty(size, dtype=torch.bool)
            # rows: frequency (float64); candidates: count (int64)
            value = torch.empty(size, dtype=torch.float64 if float_values else torch.int64)
            freq, count = (value, None) if float_values else (None, value)
            if size:
                self._lib.rim_undo_copy(
                    self._handle,
                    which,
                    *(_ptr(t) for t in (slots, ids, used, seen, freq, count)),
                )
            return [slots, ids, used, seen, value]

        rows, row_ids, occupied, last_seen, frequency = copy_out(0, True)
        undo = MapUndo(
            step,
            stats,
            rows,
            dict(zip(ROW_BUFFERS, (row_ids, occupied, last_seen, frequency), strict=True)),
            rows[:0],
        )
        if self.num_candidates:
            slots, ids, used, seen, count = copy_out(1, False)
            undo.candidate_slots = slots
            undo.candidate_values = dict(
                zip(CANDIDATE_BUFFERS, (ids, used, count, seen), strict=True)
            )
        return undo


def lfu_order(last_seen: torch.Tensor, decayed: torch.Tensor) -> torch.Tensor:
    """Positions of entries in lfu's eviction order: the lowest decayed count first, ties to
    the least recently seen, then by position (sorted by recency, then stably by count)."""
    by_recency = torch.sort(last_seen, stable=True).indices
    return by_recency[torch.sort(decayed[by_recency], stable=True).indices]


def eviction_head(idmap: IdMap, rows: torch.Tensor, count: int) -> torch.Tensor:
    """``idmap.eviction_order(rows)[:count]`` without sorting every row under lfu.

    Only the rows whose decayed count is at most the ``count``-th smallest are sorted, by
    recency then by count as the full order sorts them; their counts are computed by the
    same expression on the same rows, so the order is the same, ties included.
    """
    if idmap.config.policy == "lru" or count <= 0 or count >= rows.numel():
        return idmap.eviction_order(rows)[:count]
    last_seen = idmap.buffer("last_seen")[rows]
    age = (idmap.buffer("step") - last_seen).to(torch.float64)
    frequency = idmap.buffer("frequency")[rows] * idmap.config.lfu_decay**age
    threshold = torch.kthvalue(frequency, count).values
    near = (frequency <= threshold).nonzero().squeeze(1)  # ascending: rows in order
    return near[lfu_order(last_seen[near], frequency[near])][:count]


def _keys(idmap: IdMap, rows: torch.Tensor) -> torch.Tensor:
    """lfu's step-invariant keys ``log(frequency) - last_seen * log(decay)`` of ``rows``:
    the decayed counts (at any one step) and the keys are in the same order."""
    last_seen = idmap.buffer("last_seen")[rows].to(torch.float64)
    return idmap.buffer("frequency")[rows].log() - last_seen * math.log(idmap.config.lfu_decay)


class LowSet:
    """lfu's rows of lowest key (the set L of docs/id_map.md), kept between evicting steps.

    At a full scan the key T of the ``8 x need``-th lowest evictable row is kept, and L is
    the rows whose key is at most ``T + margin``; keys change only on rows touched or given
    a new id (`touched`), which are re-sorted in or out at the next evicting step. Victims
    are then L's first rows in the full order's exact expression, accepted only where that
    provably equals `eviction_head` over every row (see `_proven`); else None: a full scan.
    """

    def __init__(self) -> None:
        self.low_N: torch.Tensor | None = None  # bool: in L
        self.limit = 0.0  # T + margin
        self.threshold = 0.0  # T
        self.pending: list[torch.Tensor] = []  # rows touched since the last evicting step
        self.pending_rows = 0
        self.full_scans = 0
        self.served = 0

    def drop(self) -> None:
        """Forget L (the buffers were written elsewhere): the next evicting step scans."""
        self.low_N, self.pending, self.pending_rows = None, [], 0

    def touched(self, known: torch.Tensor, fresh_rows: torch.Tensor) -> None:
        """Rows whose key changed this step (counted, or given a new id)."""
        if self.low_N is not None:
            self.pending += [known, fresh_rows]
            self.pending_rows += known.numel() + fresh_rows.numel()
            if self.pending_rows > self.low_N.numel():  # long without evicting: a scan is
                self.drop()  # cheaper than re-sorting them, and the list stays bounded

    def rebuild(self, idmap: IdMap, rows: torch.Tensor, need: int) -> None:
        """After a full scan of the evictable ``rows``: L for the next steps, if useful."""
        self.full_scans += 1
        self.drop()
        size = _LOW_FACTOR * need
        if size >= rows.numel():
            return
        keys = _keys(idmap, rows)
        if not bool(torch.isfinite(keys).all()):
            return  # a count of 0 (a state written elsewhere): no keys
        self.threshold = float(torch.kthvalue(keys, size).values)
        self.limit = self.threshold + _MARGIN * (1.0 + abs(self.threshold))
        self.low_N = torch.zeros_like(idmap.buffer("occupied"))
        self.low_N[rows[keys <= self.limit]] = True

    def victims(self, idmap: IdMap, known: torch.Tensor, need: int) -> torch.Tensor | None:
        """``need`` victims from L, exactly `eviction_head`'s; None where not proven."""
        if self.low_N is None or not self._refresh(idmap):
            return None
        mask = self.low_N & idmap.buffer("occupied")
        mask[known] = False
        rows = mask.nonzero().squeeze(1)
        if rows.numel() < need:
            return None
        order = _proven(idmap, rows, need)
        if order is None:
            return None
        victims = rows[order].contiguous()
        if bool((_keys(idmap, victims) > self.threshold).any()):
            return None  # a row outside L could come between: its key may be that close
        self.served += 1
        return victims

    def _refresh(self, idmap: IdMap) -> bool:
        """Re-sort the touched rows in or out of L (False: a key is not finite)."""
        assert self.low_N is not None
        if self.pending:
            dirty = torch.cat(self.pending)
            self.pending, self.pending_rows = [], 0
            keys = _keys(idmap, dirty)
            if not bool(torch.isfinite(keys).all()):
                return False
            self.low_N[dirty] = keys <= self.limit
        return True


_LOW_FACTOR = 8  # L holds this many times the victims a scan needed: a few steps of them
_MARGIN = 1e-9  # relative, in key space: far above float64 rounding of keys and counts
_SMALLEST = 1e-290  # decayed counts (and decay powers) below: rounding is no longer relative


def _proven(idmap: IdMap, rows: torch.Tensor, need: int) -> torch.Tensor | None:
    """Positions of the first ``need`` of ``rows`` in the full order, or None if not proven.

    The full order computes ``decay ** age`` with the vectorized kernel on most rows and the
    scalar one (a chunk's tail) on a few, which may differ by an ulp: where they differ for a
    row, the row's decayed count must not tie or interleave with any other row's.
    """
    last_seen = idmap.buffer("last_seen")[rows]
    age = (idmap.buffer("step") - last_seen).to(torch.float64)
    frequency = idmap.buffer("frequency")[rows]
    decay = idmap.config.lfu_decay
    ages, inverse = torch.unique(age, return_inverse=True)
    if ages.numel() > _ONE_CHUNK:
        return None  # threads would split the powers into chunks, each with its tail
    padded = torch.cat([ages, ages.new_zeros(_PAD)])  # every age in the vectorized part
    vector = (decay**padded)[: ages.numel()][inverse]
    scalar = (decay ** ages.unsqueeze(1).expand(-1, 2).contiguous()[:, 0])[inverse]  # strided
    decayed = frequency * vector
    order = lfu_order(last_seen, decayed)[:need]
    if float(decayed[order].min()) < _SMALLEST or float(vector[order].min()) < _SMALLEST:
        return None
    differ = vector != scalar
    if bool(differ.any()):
        # Each such row that could come before the last victim must meet no other row's
        # interval of counts (rows wholly above every victim's do not change the head).
        other = frequency * scalar
        low, high = torch.minimum(decayed, other), torch.maximum(decayed, other)
        differ &= low <= high[order].max()
        meets = torch.searchsorted(torch.sort(low).values, high[differ], right=True)
        meets -= torch.searchsorted(torch.sort(high).values, low[differ])
        if bool((meets != 1).any()):
            return None
    return order


_PAD = 64  # more than two vectors of float64 on any CPU: pads the vectorized loop's tail
_ONE_CHUNK = 32768 - _PAD  # torch's grain: elementwise ops on fewer run on one thread


def remap_tables(
    maps: Mapping[str, IdMap], ids: Mapping[str, torch.Tensor], training: bool
) -> dict[str, Remapped]:
    """`IdMap.remap` of each map on its ids; the native lru maps in training in one call.

    That call steps the maps in parallel over torch's threads and saves the per-map call
    overhead; every other map (lfu, undo records, torch path, reads) is remapped on its own.
    """
    results: dict[str, Remapped] = {}
    together: list[tuple[str, IdMap, NativeIdMap, torch.Tensor]] = []
    for name, idmap in maps.items():
        ids_M = ids[name].to(torch.int64)
        native = None
        if training and idmap.config.policy == "lru" and ids_M.device.type == "cpu":
            native = idmap._native()
        if native is None:
            results[name] = idmap.remap(ids_M, training)
        else:
            together.append((name, idmap, native, ids_M.contiguous()))
    if together:
        results.update(_step_many(together))
    return {name: results[name] for name in maps}


def _step_many(
    together: list[tuple[str, IdMap, NativeIdMap, torch.Tensor]],
) -> dict[str, Remapped]:
    count = len(together)
    sizes = [ids_M.numel() for _, _, _, ids_M in together]
    out = torch.empty(3 * sum(sizes), dtype=torch.int64)  # rows, fresh rows, fresh ids
    views = out.split([size for size in sizes for _ in range(3)])
    buffers: list[int | None] = []
    steps, ttls, handles, ids_p = [], [], [], []
    for _, idmap, native, ids_M in together:
        own = native._sync(idmap)[:]
        buffers += own + [None] * (8 - len(own))  # 8 a map: rows', then candidates'
        step_t = idmap._buffers["step"]
        assert step_t is not None
        step_t.add_(1)
        steps.append(int(step_t))
        ttls.append(idmap.config.ttl_steps or 0)
        handles.append(native._handle.value)
        ids_p.append(_ptr(ids_M))
    pointers = [v.data_ptr() if v.numel() else None for v in views]

    def p_array(values: Sequence[int | None]) -> ctypes.Array[ctypes.c_void_p]:
        return (ctypes.c_void_p * len(values))(*values)

    def i_array(values: Sequence[int]) -> ctypes.Array[ctypes.c_int64]:
        return (ctypes.c_int64 * len(values))(*values)

    stats_out, status = (ctypes.c_int64 * (6 * count))(), (ctypes.c_int64 * count)()
    cpu_id_map.library().rim_step_many(
        count, p_array(handles), p_array(buffers), p_array(ids_p), i_array(sizes),
        i_array(steps), i_array(ttls), i_array([idmap.admit_after for _, idmap, _, _ in together]),
        p_array(pointers[0::3]), p_array(pointers[1::3]), p_array(pointers[2::3]), stats_out,
        status, torch.get_num_threads(),
    )  # fmt: skip
    results = {}
    flat_stats = stats_out[:]
    for i, (name, idmap, native, _) in enumerate(together):
        if status[i] != 0:
            raise MemoryError("id map: no memory for the native remap's scratch")
        stats = _stepped(idmap, steps[i], native.num_rows, flat_stats[6 * i : 6 * i + 6])
        placed = stats.new_ids
        rows_M, fresh_rows, fresh_ids = views[3 * i : 3 * i + 3]
        results[name] = Remapped(rows_M, fresh_rows[:placed], fresh_ids[:placed], stats)
    return results


def _stepped(idmap: IdMap, step: int, num_rows: int, out: Sequence[int]) -> RemapStats:
    """The stats of a native step from its six counters, recorded on ``idmap``."""
    placed, evictions, expired, admissions, zero_row_ids, live = out
    stats = RemapStats(
        step=step,
        occupancy=float(live) / num_rows,
        new_ids=placed,
        evictions=evictions,
        expired=expired,
        admissions=admissions,
        zero_row_ids=zero_row_ids,
    )
    idmap.native_stepped(stats)
    return stats
