"""The native id-map remap (cpu_id_map.c): built with the system C compiler at first use.

Like `cpu_fused`, a small C library without torch headers, compiled once per source and
machine into a cache directory and loaded with ctypes. Without a compiler `available()` is
False and `IdMap` uses its torch ops. This file only loads the library and declares its
functions; `recopt/modules/id_map_native.py` drives it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from recopt.kernels.native_build import LazyLibrary, build_library

logger = logging.getLogger(__name__)

_C_SOURCE_PATH = Path(__file__).with_name("cpu_id_map.c")
# included by the source
_C_HEADERS = [
    Path(__file__).with_name(f"cpu_id_map_{name}.h")
    for name in ("slots", "fill", "lfu", "lfu_buckets", "batch")
] + [Path(__file__).with_name("cpu_splitmix.h")]
# -ffp-contract=off: lfu's frequency update (f * factor + count) rounds twice, as torch does.
_CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fopenmp"]

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "rim_new": (_P, [_I64, _I64, ctypes.c_double]),
    "rim_free": (None, [_P]),
    "rim_rebuild": (_INT, [_P, _P]),
    "rim_lookup": (_INT, [_P, _P, _P, _I64, _I64, _I64, _P]),
    "rim_begin": (_I64, [_P, _P, _P, _I64, _I64, _I64, _INT]),
    "rim_middle": (_INT, [_P, _P, _I64, _I64]),
    "rim_finish": (_INT, [_P, _P, _I64, _INT, _P, _I64, _P, _P, _P]),
    "rim_hash_uniform": (None, [_P, _I64, _I64, _I64, _P]),
    "rim_fill_uniform": (
        None,
        [_P, _P, _I64, _I64, _I64, ctypes.c_double, ctypes.c_double, _P, _I64],
    ),
    "rim_step_many": (None, [_I64, *[_P] * 13, _INT, _INT]),
    "rim_undo_sizes": (None, [_I64, _P, _INT, _P]),
    "rim_undo_copy_many": (None, [_I64, _P, _INT, *[_P] * 7]),
    "rim_decay_powers": (None, [ctypes.c_double, _P, _I64, _P]),
    "rim_reset_many": (None, [_I64, *[_P] * 13, _INT]),
    "rim_drop_zero_rows": (_I64, [_I64, _I64, _P, _P, _P, _I64, *[_P] * 5]),
    "rim_set_lfu_buckets_min_rows": (_I64, [_I64]),
}


def _build() -> ctypes.CDLL:
    """Compile the C source (once per source, flags and machine) and load it."""
    return build_library(_C_SOURCE_PATH, _C_HEADERS, _CFLAGS, _SIGNATURES)


_native = LazyLibrary("native id map", _build)


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    return _native.available()


def library() -> ctypes.CDLL:
    """The loaded library.

    Raises:
        RuntimeError: it is not available (call `available()` first).
    """
    return _native.get("cpu_id_map")


def hash_uniform(ids_K: torch.Tensor, step: int, dim: int) -> torch.Tensor:
    """`recopt.modules.id_map_rows.hash_uniform` (the same bits) in native code.

    Raises:
        RuntimeError: the library is not available.
    """
    ids_K = ids_K.to(torch.int64).contiguous()
    out = torch.empty(ids_K.numel(), dim, dtype=torch.float64)
    if out.numel():
        library().rim_hash_uniform(ids_K.data_ptr(), ids_K.numel(), step, dim, out.data_ptr())
    return out


def decay_powers(decay: float, ages: torch.Tensor) -> torch.Tensor:
    """``decay ** ages`` as the native maps compute lfu's decay (float64; the torch path's
    `recopt.modules.id_map.decay_powers` must give the same bits).

    Raises:
        RuntimeError: the library is not available.
    """
    ages = ages.to(torch.int64).contiguous()
    out = torch.empty(ages.shape, dtype=torch.float64)
    if out.numel():
        library().rim_decay_powers(decay, ages.data_ptr(), ages.numel(), out.data_ptr())
    return out


def drop_zero_rows(
    rows: torch.Tensor, offsets: torch.Tensor, mapped: Sequence[bool], weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list[int]] | None:
    """A remapped batch's rows with the zero row's ids (-1) dropped from the bags of the keys
    marked in ``mapped`` (one flag per key; each key ``stride`` bags, ``offsets`` into
    ``rows``), in one pass: the kept rows, their ``weights`` (None: unweighted), each bag's
    kept count (int64) and each key's. None (nothing done) unless the rows are int64 on CPU,
    the weights float32 there, the bags as many per key, and the library available."""
    keys, bags = len(mapped), offsets.numel() - 1
    if (
        rows.device.type != "cpu"
        or rows.dtype != torch.int64
        or offsets.device.type != "cpu"
        or (weights is not None and (weights.device.type, weights.dtype) != ("cpu", torch.float32))
        or keys == 0
        or bags % keys
        or not available()
    ):
        return None
    rows, offsets = rows.contiguous(), int64_contiguous(offsets)
    weights = None if weights is None else weights.contiguous()
    rows_out = torch.empty_like(rows)
    weights_out = None if weights is None else torch.empty_like(weights)
    lengths = torch.empty(bags, dtype=torch.int64)
    per_key = (ctypes.c_int64 * keys)()
    kept = library().rim_drop_zero_rows(
        keys, bags // keys, offsets.data_ptr(), (ctypes.c_uint8 * keys)(*mapped),
        rows.data_ptr(), rows.numel(), None if weights is None else weights.data_ptr(),
        rows_out.data_ptr(), None if weights_out is None else weights_out.data_ptr(),
        lengths.data_ptr(), per_key,
    )  # fmt: skip
    kept_weights = None if weights_out is None else weights_out[:kept]
    return rows_out[:kept], kept_weights, lengths, per_key[:]


def lfu_buckets_min_rows(rows: int | None = None) -> int:
    """The rows from which native lfu maps keep their rows in buckets by key (below: every
    row's key read at each evicting step; cpu_id_map_lfu_buckets.h); with ``rows``, set it
    for maps (re)built from then on (tests run both ways). Returns the value before.

    Raises:
        RuntimeError: the library is not available.
    """
    return int(library().rim_set_lfu_buckets_min_rows(-1 if rows is None else rows))


def fill_uniform(
    weight: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, step: int, lo: float, hi: float
) -> bool:
    """``weight[rows] = lo + (hi - lo) * hash_uniform(ids, step, dim)`` in place, as the torch
    ops round it; False (nothing done) unless ``weight`` is a CPU float32 matrix with unit
    column stride and the library is available."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or weight.stride(1) != 1
        or not available()
    ):
        return False
    rows, ids = rows.to(torch.int64).contiguous(), ids.to(torch.int64).contiguous()
    if rows.numel():
        library().rim_fill_uniform(
            ids.data_ptr(),
            rows.data_ptr(),
            rows.numel(),
            step,
            weight.shape[1],
            lo,
            hi,
            weight.data_ptr(),
            weight.stride(0),
        )
        weight[rows[:0]] = 0.0  # writes nothing; moves the version counter as torch's would
    return True


class ResetTable(NamedTuple):
    """What `reset_many` takes of a table that stays the same from step to step (its weight
    and states' addresses, widths and strides, its init bounds): worked out once per table
    where its owner keeps the table (`of`), so a step's `prepare_reset_at` only adds the rows.
    It keeps ``weight`` and ``states`` alive (its addresses point into them)."""

    weight: torch.Tensor
    states: tuple[torch.Tensor, ...]
    lo: float
    hi: float
    dim: int
    weight_stride: int
    state_strides: tuple[int, ...]  # bytes
    state_widths: tuple[int, ...]  # a row's bytes

    @staticmethod
    def of(
        weight: torch.Tensor, states: Sequence[torch.Tensor], lo: float, hi: float
    ) -> ResetTable:
        return ResetTable(
            weight, tuple(states), lo, hi, weight.shape[1], weight.stride(0),
            tuple(s.stride(0) * s.element_size() for s in states),
            tuple(math.prod(s.shape[1:]) * s.element_size() for s in states),
        )  # fmt: skip


class RowReset(NamedTuple):
    """One table's fresh rows for `reset_many`: ``weight[rows]`` gets ``lo + (hi - lo) *
    hash_uniform(ids, step, dim)`` (or ``values``, those values made earlier by `fill_values`)
    and each of ``states`` (per-row ``[N]`` or per-element ``[N, D]``) is zeroed on ``rows``."""

    weight: torch.Tensor
    rows: torch.Tensor
    ids: torch.Tensor
    step: int
    lo: float
    hi: float
    states: Sequence[torch.Tensor]
    values: torch.Tensor | None = None


def can_reset(weight: torch.Tensor, states: Sequence[torch.Tensor]) -> bool:
    """Whether `reset_many` takes a table with ``weight`` and ``states``: a CPU float32 matrix
    with unit column stride, states on CPU with contiguous rows, and the library there."""

    def rows_contiguous(state: torch.Tensor) -> bool:
        return state.dim() == 1 or (state.dim() == 2 and state.stride(1) == 1)

    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.stride(1) == 1
        and all(s.device.type == "cpu" and rows_contiguous(s) for s in states)
        and available()
    )


def fill_values(
    ids: Sequence[torch.Tensor], steps: Sequence[int], dims: Sequence[int],
    bounds: Sequence[tuple[float, float]], threads: int,
) -> list[torch.Tensor]:  # fmt: skip
    """For each table, ``[len(ids[t]), dims[t]]`` float32: the values `reset_many` would write
    into fresh rows of ids ``ids[t]`` at ``steps[t]`` with init bounds ``bounds[t]`` (the same
    bits), for a later `RowReset` to copy (`fill_values_at` of the tensors)."""
    flat_ids = [int64_contiguous(t) for t in ids]
    counts = [t.numel() for t in flat_ids]
    at = [t.data_ptr() for t in flat_ids]
    values, starts = fill_values_at(at, counts, steps, dims, bounds, threads)
    return [
        values[start : start + count * dim].view(count, dim)
        for start, count, dim in zip(starts, counts, dims, strict=True)
    ]


def fill_values_at(
    ids: Sequence[int], counts: Sequence[int], steps: Sequence[int], dims: Sequence[int],
    bounds: Sequence[tuple[float, float]], threads: int,
) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """`fill_values` of ids given by address (``counts[t]`` int64 at ``ids[t]``, kept alive by
    the caller), into one float32 buffer: table t's ``[counts[t], dims[t]]`` row-major from
    element ``starts[t]``; returns the buffer and ``starts``. One native call, the tables over
    ``threads``, their rows (value i is row i) one ``arange`` kept for all (few torch ops: a
    pipeline's worker makes these beside the training step)."""
    sizes = [count * dim for count, dim in zip(counts, dims, strict=True)]
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    values = torch.empty(sum(sizes), dtype=torch.float32)
    base = values.data_ptr()
    rows = _row_numbers(max(counts, default=0))
    lo_hi = [bound for pair in bounds for bound in pair]
    library().rim_reset_many(
        len(ids), pointers([rows.data_ptr()] * len(ids)), pointers(ids), int64s(counts),
        int64s(steps), int64s(dims), (ctypes.c_double * max(len(lo_hi), 1))(*lo_hi),
        pointers([base + 4 * start for start in starts]), int64s(dims),
        int64s([0] * (len(ids) + 1)), pointers([]), int64s([]), int64s([]), None, threads,
    )  # fmt: skip
    return values, starts


class _Numbers:
    """0, 1, 2, ... as int64, grown when a longer run is asked for (never written: the
    threads that read an older one keep it)."""

    made = torch.arange(0)


def _row_numbers(count: int) -> torch.Tensor:
    """At least ``count`` int64 values 0, 1, 2, ... (the rows of values made ahead)."""
    made = _Numbers.made
    if made.numel() < count:
        made = _Numbers.made = torch.arange(max(count, 2 * made.numel()))
    return made


def int64s(values: Sequence[int]) -> ctypes.Array[ctypes.c_int64]:
    """``values`` as a C ``int64_t[]`` argument (one element at least)."""
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def pointers(values: Sequence[int | None]) -> ctypes.Array[ctypes.c_void_p]:
    """Addresses (None: NULL) as a C ``void *[]`` argument (one element at least)."""
    return (ctypes.c_void_p * max(len(values), 1))(*values)


def _pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    return pointers([t.data_ptr() for t in tensors])


def int64_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int64 tensor: itself when it is one (two attribute reads, no op)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def reset_many(resets: Sequence[RowReset], threads: int) -> None:
    """Every `RowReset` of ``resets`` in one native call, the tables over ``threads``
    threads: the same bits as `fill_uniform` and ``state[rows] = 0`` (all-zero bytes).

    Every table must pass `can_reset`; the version counters of the weights and states move
    as in-place torch writes would move them.
    """
    prepare_reset(resets)(threads)


def prepare_reset(resets: Sequence[RowReset]) -> Callable[[int], None]:
    """`reset_many` of ``resets``, its arguments made now and the call (given its threads)
    left for later: a pipeline's worker makes them, the forward only calls. The tensors must
    stay where they are until the call (it keeps them alive)."""
    resets = [r for r in resets if r.rows.numel()]
    rows = [int64_contiguous(r.rows) for r in resets]
    ids = [int64_contiguous(r.ids) for r in resets]
    at = [
        RowsAt(
            r.data_ptr(), i.data_ptr(), r.numel(), reset.step,
            None if reset.values is None else reset.values.data_ptr(),
        )
        for r, i, reset in zip(rows, ids, resets, strict=True)
    ]  # fmt: skip
    tables = [ResetTable.of(r.weight, r.states, r.lo, r.hi) for r in resets]
    return prepare_reset_at(tables, at, (rows, ids, [r.values for r in resets]))


class RowsAt(NamedTuple):
    """One table's fresh rows for `prepare_reset_at`, by address: ``num_rows`` int64 rows at
    ``rows``, their ids at ``ids``, the step, and their initial weights made earlier at
    ``values`` (float32, ``[num_rows, dim]`` row-major; None: hashed by the call)."""

    rows: int
    ids: int
    num_rows: int
    step: int
    values: int | None


class ResetTables(NamedTuple):
    """The arguments of `prepare_reset_at` for ``tables`` that stay the same from step to step
    (their widths, bounds, weights and states), made once (`of`) where the tables are kept."""

    tables: tuple[ResetTable, ...]
    dims: ctypes.Array[ctypes.c_int64]
    lo_hi: ctypes.Array[ctypes.c_double]
    weights: ctypes.Array[ctypes.c_void_p]
    weight_strides: ctypes.Array[ctypes.c_int64]
    first_state: ctypes.Array[ctypes.c_int64]
    states: ctypes.Array[ctypes.c_void_p]
    state_strides: ctypes.Array[ctypes.c_int64]
    state_widths: ctypes.Array[ctypes.c_int64]
    written: list[torch.Tensor]  # the weights and states: their version counters move

    @staticmethod
    def of(tables: Sequence[ResetTable]) -> ResetTables:
        states = [state for t in tables for state in t.states]
        lo_hi = [bound for t in tables for bound in (t.lo, t.hi)]
        return ResetTables(
            tuple(tables),
            int64s([t.dim for t in tables]),
            (ctypes.c_double * max(len(lo_hi), 1))(*lo_hi),
            _pointers([t.weight for t in tables]),
            int64s([t.weight_stride for t in tables]),
            int64s(list(itertools.accumulate([0, *(len(t.states) for t in tables)]))),
            _pointers(states),
            int64s([stride for t in tables for stride in t.state_strides]),
            int64s([width for t in tables for width in t.state_widths]),
            [t.weight for t in tables] + states,
        )


def prepare_reset_at(
    tables: ResetTables | Sequence[ResetTable], rows: Sequence[RowsAt], keep: object
) -> Callable[[int], None]:
    """`prepare_reset` of table ``tables[t]``'s ``rows[t]`` (``keep``: what their addresses
    point into, held until the call); ``tables`` as `ResetTables` where they were made once."""
    if not any(r.num_rows for r in rows):
        return lambda threads: None
    fixed = tables if isinstance(tables, ResetTables) else ResetTables.of(tables)
    assert len(fixed.tables) == len(rows)
    args = (
        len(rows),
        pointers([r.rows for r in rows]),
        pointers([r.ids for r in rows]),
        int64s([r.num_rows for r in rows]),
        int64s([r.step for r in rows]),
        fixed.dims,
        fixed.lo_hi,
        fixed.weights,
        fixed.weight_strides,
        fixed.first_state,
        fixed.states,
        fixed.state_strides,
        fixed.state_widths,
        pointers([r.values for r in rows]),
    )
    written = fixed.written
    kept = (keep, fixed)  # what the pointers point into

    def call(threads: int) -> None:
        assert kept
        library().rim_reset_many(*args, threads)
        torch.autograd.graph.increment_version(written)  # as torch's in-place writes would

    return call
