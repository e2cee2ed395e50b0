"""The remap of an `IdMap` on CPU in native code (recopt/kernels/cpu_id_map.c): O(batch) a step.

The map's state stays in the `IdMap`'s buffers (the native side writes them in place); the
native side only adds a cache derived from them (hash table id -> row, recency list, free-row
heap), rebuilt when the buffers changed elsewhere, which their torch version counters and
data pointers tell (native writes leave the counters alone). It gives exactly the torch
path's results, lfu's included: both compute its decay powers as the same products
(`recopt.modules.id_map.decay_powers`), and the native side finds lfu's victims in one pass
over the rows of a step that evicts.
Legend: M ids of a batch, N rows.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from recopt.kernels import cpu_id_map
from recopt.modules.id_map_results import (
    CANDIDATE_BUFFERS,
    ROW_BUFFERS,
    FreshBlock,
    MapUndo,
    Remapped,
    RemapStats,
    results_to,
)

if TYPE_CHECKING:
    from recopt.modules.id_map import IdMap

_Stamp = tuple[tuple[int, int], ...]
# `NativeIdMap.step_args`: handle, lfu, ttl, admit_after, step address, 8 buffer addresses
_StepArgs = tuple[int | None, int, int, int, int, tuple[int | None, ...]]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


class NativeIdMap:
    """The native cache of one `IdMap` (owned by it; see `IdMap.remap`).

    Args:
        num_rows: the map's rows.
        num_candidates: its candidate slots (0 without admission).
        decay: lfu's per-step decay (1.0 under lru).

    Raises:
        MemoryError: the native side could not allocate its cache.
    """

    def __init__(self, num_rows: int, num_candidates: int, decay: float) -> None:
        self._lib = cpu_id_map.library()
        self.num_rows, self.num_candidates, self.decay = num_rows, num_candidates, decay
        handle = self._lib.rim_new(num_rows, num_candidates, decay)
        if not handle:
            raise MemoryError(f"id map: no memory for the native cache of {num_rows} rows")
        self._handle = ctypes.c_void_p(handle)
        self._names = ROW_BUFFERS + (CANDIDATE_BUFFERS if num_candidates else ())
        self._stamp: _Stamp | None = None
        self._pointers: ctypes.Array[ctypes.c_void_p] | None = None
        self._step_args: tuple[object, _StepArgs] | None = None  # (its key, `step_args`)
        # `_group_args`' arrays for the maps stepped with this one first, and their args
        self.group: tuple[list[_StepArgs], _GroupArrays] | None = None
        self.logs: _NativeLogs | None = None  # the deferred undo records of its last step

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            self._lib.rim_free(handle)

    def __deepcopy__(self, memo: dict[int, object]) -> NativeIdMap:
        return NativeIdMap(self.num_rows, self.num_candidates, self.decay)  # rebuilt at use

    def __reduce__(self) -> tuple[type, tuple[int, int, float]]:
        return NativeIdMap, (self.num_rows, self.num_candidates, self.decay)

    def keep_log(self) -> None:
        """Before a step (which overwrites the native log): copy out the last step's deferred
        undo records, unless they were released."""
        logs = self.logs
        if logs is not None:
            logs.fill()

    def invalidate(self) -> None:
        """Rebuild the cache from the buffers at the next use (`IdMap.buffers_changed`)."""
        self._stamp = None

    def _sync(self, idmap: IdMap) -> ctypes.Array[ctypes.c_void_p]:
        """The buffers' pointers, after rebuilding the cache if they changed elsewhere."""
        own = idmap._buffers  # the module's buffer table: no nn.Module attribute lookups
        buffers = [b for b in [own[name] for name in self._names] if b is not None]
        stamp = tuple([(b.data_ptr(), b._version) for b in buffers])
        if stamp != self._stamp or self._pointers is None:
            assert len(buffers) == len(self._names) and all(b.is_contiguous() for b in buffers)
            self._pointers = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
            if self._lib.rim_rebuild(self._handle, self._pointers) != 0:
                raise MemoryError("id map: no memory to rebuild the native cache")
            self._stamp = stamp
        return self._pointers

    def step_args(self, idmap: IdMap) -> _StepArgs:
        """What `rim_step_many` takes of this map besides its ids and outputs: its handle,
        lfu flag, ttl, admission count, step counter's address, and its 8 buffer addresses
        (rows', then candidates' or NULL); made again only when a buffer moved (`_sync`)."""
        pointers = self._sync(idmap)
        step_t = _step_buffer(idmap)
        key = (pointers, step_t.data_ptr())
        if self._step_args is None or self._step_args[0] != key:
            config = idmap.config
            own = (*pointers[:], *[None] * (8 - len(pointers)))
            head = (self._handle.value, int(config.policy == "lfu"), config.ttl_steps or 0)
            self._step_args = key, (*head, idmap.admit_after, step_t.data_ptr(), own)
        return self._step_args[1]

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
        self.keep_log()
        num_known = self._lib.rim_begin(
            self._handle,
            pointers,
            _ptr(ids_M),
            num_ids,
            step,
            idmap.config.ttl_steps or 0,
            int(record_undo),
        )
        if num_known < 0:
            raise MemoryError("id map: no memory for the native remap's scratch")
        self._lib.rim_middle(self._handle, pointers, step, idmap.admit_after)
        out = torch.empty(3 * num_ids, dtype=torch.int64)  # rows, fresh rows, fresh ids
        rows_M, fresh_rows, fresh_ids = (out[i * num_ids : (i + 1) * num_ids] for i in range(3))
        counters = (ctypes.c_int64 * 6)()
        status = self._lib.rim_finish(
            self._handle,
            pointers,
            step,
            int(idmap.config.policy == "lfu"),
            _ptr(rows_M),
            num_ids,
            _ptr(fresh_rows),
            _ptr(fresh_ids),
            counters,
        )
        stats = _stepped(idmap, step, self.num_rows, list(counters))
        placed = stats.new_ids
        result = Remapped(rows_M, fresh_rows[:placed], fresh_ids[:placed], stats)
        if record_undo:
            if status != 0:
                raise MemoryError("id map: no memory for the undo record")
            result.undo = _NativeLogs([self], [old_step], [old_stats]).undos[0]
        return result


def remap_tables(
    maps: Mapping[str, IdMap],
    ids: Mapping[str, torch.Tensor],
    training: bool,
    record_undo: bool = False,
    threads: int | None = None,
    rows_into: torch.Tensor | None = None,
) -> dict[str, Remapped]:
    """`IdMap.remap` of each map on its ids; the native maps in training in one call.

    That call steps the maps (lru and lfu) in parallel over ``threads`` (None: torch's) and
    saves the per-map call overhead; every other map (torch path, reads) is remapped on its
    own. ``record_undo``: each training result carries its `MapUndo` (`IdMap.remap`). Ids on
    a device (a CUDA table's ids; its map is on the host) come over in one copy per device
    and their rows go back in one.

    ``rows_into``: where the rows go when every map is native and trains (a contiguous int64
    host tensor, each map's rows after the previous map's, in ``maps`` order: a batch's new
    values, written by the native call itself); ignored otherwise (`Remapped.rows_M` says
    where they are).
    """
    results: dict[str, Remapped] = {}
    natives: dict[str, NativeIdMap] = {}
    for name, idmap in maps.items():
        native = idmap._native() if training else None
        if native is None:
            results[name] = idmap.remap(ids[name], training, record_undo)
        else:
            natives[name] = native
    if natives:
        host_ids = _on_host({name: ids[name] for name in natives})
        together = [(name, maps[name], native, host_ids[name]) for name, native in natives.items()]
        count = torch.get_num_threads() if threads is None else threads
        whole = rows_into is not None and len(natives) == len(maps)
        done = _step_many(together, record_undo, count, rows_into if whole else None)
        for device in {ids[name].device for name in natives}:
            names = [name for name in natives if ids[name].device == device]
            results.update(results_to({name: done[name] for name in names}, device))
    return {name: results[name] for name in maps}


def _on_host(ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``ids`` as contiguous int64 host tensors, those on a device copied in one transfer."""
    out = {n: cpu_id_map.int64_contiguous(v) for n, v in ids.items() if v.device.type == "cpu"}
    away = [name for name in ids if name not in out]
    for device in {ids[name].device for name in away}:
        names = [name for name in away if ids[name].device == device]
        parts = [ids[name].to(torch.int64) for name in names]
        host = torch.cat(parts).cpu().split([p.numel() for p in parts])
        out.update(zip(names, host, strict=True))
    return out


def _step_buffer(idmap: IdMap) -> torch.Tensor:
    step_t = idmap._buffers["step"]  # no nn.Module attribute lookup: a hot path
    assert step_t is not None and step_t.dtype == torch.int64 and step_t.device.type == "cpu"
    return step_t


def _step_many(
    together: list[tuple[str, IdMap, NativeIdMap, torch.Tensor]],
    record: bool,
    threads: int,
    rows_into: torch.Tensor | None = None,
) -> dict[str, Remapped]:
    """One `rim_step_many` call for ``together``'s maps (host time kept low: on a pipeline's
    worker it runs beside the training step, and on a GPU that step is short); the rows
    written into ``rows_into`` when given (`remap_tables`)."""
    count = len(together)
    sizes = [ids_M.numel() for _, _, _, ids_M in together]
    total = sum(sizes)
    # every map's rows, then every map's fresh rows, then fresh ids: [3, total], one buffer
    # addressed by offsets (views only for what the results keep); the rows part unused
    # when they go into ``rows_into``
    out = torch.empty(3 * total, dtype=torch.int64)
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    base = out.data_ptr()
    if rows_into is None:
        rows_M = out[:total].split(sizes)
    else:
        assert rows_into.dtype == torch.int64 and rows_into.is_contiguous()
        assert rows_into.device.type == "cpu" and rows_into.numel() == total
        rows_M = rows_into.split(sizes)
    rows_base = rows_into.data_ptr() if rows_into is not None else base
    handles, lfu, buffers, steps_at, ttl, admit = _group_args(together)
    for _, _, native, _ in together:
        native.keep_log()
    ptrs, int64s = cpu_id_map.pointers, cpu_id_map.int64s
    stats_out, status = (ctypes.c_int64 * (7 * count))(), (ctypes.c_int64 * count)()
    # the step counters move in the native call (their version counters stay, as the other
    # buffers' do there): no torch op, and the new steps come back in the stats
    cpu_id_map.library().rim_step_many(
        count, handles, lfu, buffers, ptrs([_ptr(ids_M) for _, _, _, ids_M in together]),
        int64s(sizes), steps_at, ttl, admit, ptrs([rows_base + 8 * start for start in starts]),
        *(ptrs([base + 8 * (part * total + start) for start in starts]) for part in (1, 2)),
        stats_out, status, int(record), threads,
    )  # fmt: skip
    if any(status):
        raise MemoryError("id map: no memory for the native remap's scratch or undo record")
    results, befores = {}, []
    flat_stats = stats_out[:]
    steps = flat_stats[6::7]
    # each map's fresh rows and ids: the first `placed` of its part (views made when read)
    block = FreshBlock(out, total, starts, flat_stats[0::7])
    for i, (name, idmap, native, _) in enumerate(together):
        before = idmap.last_stats
        stats = _stepped(idmap, steps[i], native.num_rows, flat_stats[7 * i : 7 * i + 6])
        # zero_row: the ids left without a row (those that read it), counted by the call
        results[name] = Remapped.in_block(rows_M[i], stats, stats.zero_row_ids > 0, block, i)
        befores.append(before)
    if record:
        natives = [native for _, _, native, _ in together]
        logs = _NativeLogs(natives, [step - 1 for step in steps], befores)
        for (name, *_), undo in zip(together, logs.undos, strict=True):
            results[name].undo = undo
    return results


_GroupArrays = tuple[ctypes.Array[Any], ...]


def _group_args(together: list[tuple[str, IdMap, NativeIdMap, torch.Tensor]]) -> _GroupArrays:
    """`rim_step_many`'s per-map arguments that stay the same from step to step, as its C
    arrays (handles, lfu flags, buffers, step counters, ttls, admission counts): kept on the
    first map's cache for this group of maps while every map's `step_args` stay the same."""
    args = [native.step_args(idmap) for _, idmap, native, _ in together]
    first = together[0][2]
    kept = first.group
    same = kept is not None and len(kept[0]) == len(args)
    if kept is None or not same or any(a is not b for a, b in zip(kept[0], args, strict=True)):
        handles, lfu, ttl, admit, steps_at, buffers = zip(*args, strict=True)
        ptrs, int64s = cpu_id_map.pointers, cpu_id_map.int64s
        arrays = (
            ptrs(handles), int64s(lfu), ptrs(list(itertools.chain.from_iterable(buffers))),
            ptrs(steps_at), int64s(ttl), int64s(admit),
        )  # fmt: skip
        first.group = kept = args, arrays
    return kept[1]


class _NativeLogs:
    """The deferred undo records (`MapUndo.deferred`) of one native step of ``natives``
    (``steps``, ``stats``: before it): left in the native side's logs (each map keeps its
    last step's) and copied out, for all maps in two calls, when one is first read or before
    one of those maps steps again (`NativeIdMap.keep_log`); dropped uncopied once every
    record is released. A pipeline's worker and its main thread may both come here: a lock."""

    def __init__(
        self, natives: Sequence[NativeIdMap], steps: Sequence[int], stats: Sequence[RemapStats]
    ) -> None:
        self._natives: Sequence[NativeIdMap] | None = natives
        self.undos = [MapUndo.deferred(s, st, self) for s, st in zip(steps, stats, strict=True)]
        self._unreleased = len(self.undos)
        self._lock = threading.Lock()
        for native in natives:
            native.logs = self

    def fill(self) -> None:
        """Copy the records out, once (a released record's reads fail in `MapUndo`)."""
        with self._lock:
            natives = self._natives
            if natives is None:  # copied already, or every record released
                return
            _copy_undos(natives, self.undos)
            self._detach(natives)

    def release(self) -> None:
        """One record will not be read; none left to read: the logs are forgotten."""
        with self._lock:
            self._unreleased -= 1
            if self._unreleased == 0 and self._natives is not None:
                self._detach(self._natives)

    def _detach(self, natives: Sequence[NativeIdMap]) -> None:
        for native in natives:
            if native.logs is self:
                native.logs = None
        self._natives = None


def _copy_undos(natives: Sequence[NativeIdMap], undos: Sequence[MapUndo]) -> None:
    """Set each map's undo record's tensors from its last step's native log, copied out in
    two calls for all maps."""
    handles = [native._handle.value for native in natives]
    rows = _copy_logs(handles, 0, True)
    with_candidates = any(native.num_candidates for native in natives)
    candidates = _copy_logs(handles, 1, False) if with_candidates else None
    for i, (native, undo) in enumerate(zip(natives, undos, strict=True)):
        undo.rows, *values = rows[i]
        undo.row_values = dict(zip(ROW_BUFFERS, values, strict=True))
        undo.candidate_slots, undo.candidate_values = undo.rows[:0], {}
        if candidates is not None and native.num_candidates:
            undo.candidate_slots, *values = candidates[i]
            undo.candidate_values = dict(zip(CANDIDATE_BUFFERS, values, strict=True))


def _copy_logs(handles: list[int | None], which: int, rows: bool) -> list[list[torch.Tensor]]:
    """Per map, its last step's log (``which`` 0: rows, 1: candidates): the slots, then the
    old values in `ROW_BUFFERS` order (``rows``: the last is the float64 frequency) or
    `CANDIDATE_BUFFERS` order (ids, used, count, last seen)."""
    library, count = cpu_id_map.library(), len(handles)
    sizes = (ctypes.c_int64 * count)()
    library.rim_undo_sizes(count, cpu_id_map.pointers(handles), which, sizes)
    split = sizes[:]
    total = sum(split)
    slots, ids, seen = (torch.empty(total, dtype=torch.int64) for _ in range(3))
    used = torch.empty(total, dtype=torch.bool)
    value = torch.empty(total, dtype=torch.float64 if rows else torch.int64)
    if total:
        offsets = cpu_id_map.int64s(list(itertools.accumulate([0, *split[:-1]])))
        freq, counts = (value, None) if rows else (None, value)
        library.rim_undo_copy_many(
            count, cpu_id_map.pointers(handles), which, offsets,
            *(_ptr(t) for t in (slots, ids, used, seen, freq, counts)),
        )  # fmt: skip
    ordered = (slots, ids, used, seen, value) if rows else (slots, ids, used, value, seen)
    parts = [tensor.split(split) for tensor in ordered]
    return [list(fields) for fields in zip(*parts, strict=True)]


def _stepped(idmap: IdMap, step: int, num_rows: int, out: Sequence[int]) -> RemapStats:
    """The stats of a native step from its six counters, recorded on ``idmap``."""
    placed, evictions, expired, admissions, zero_row_ids, live = out
    occupancy = float(live) / num_rows
    stats = RemapStats(step, occupancy, placed, evictions, expired, admissions, zero_row_ids)
    idmap.native_stepped(stats)
    return stats
