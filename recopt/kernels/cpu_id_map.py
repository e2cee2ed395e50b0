"""The native id-map remap (cpu_id_map.c): built with the system C compiler at first use.

Like `cpu_fused`, a small C library without torch headers, compiled once per source and
machine into a cache directory and loaded with ctypes. Without a compiler `available()` is
False and `IdMap` uses its torch ops. This file only loads the library and declares its
functions; `recopt/modules/id_map_native.py` drives it.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from recopt.kernels.native_build import LazyLibrary, build_library

logger = logging.getLogger(__name__)

_C_SOURCE_PATH = Path(__file__).with_name("cpu_id_map.c")
_C_HEADER_PATH = Path(__file__).with_name("cpu_id_map_slots.h")  # included by the source
# -ffp-contract=off: lfu's frequency update (f * factor + count) rounds twice, as torch does.
_CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fopenmp"]

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "rim_new": (_P, [_I64, _I64]),
    "rim_free": (None, [_P]),
    "rim_rebuild": (_INT, [_P, _P]),
    "rim_lookup": (_INT, [_P, _P, _P, _I64, _I64, _I64, _P]),
    "rim_begin": (_I64, [_P, _P, _P, _I64, _I64, _I64, _INT, _P]),
    "rim_middle": (_INT, [_P, _P, _I64, _P, _I64, _P]),
    "rim_finish": (_INT, [_P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P]),
    "rim_undo_size": (_I64, [_P, _INT]),
    "rim_undo_copy": (None, [_P, _INT, _P, _P, _P, _P, _P, _P]),
    "rim_hash_uniform": (None, [_P, _I64, _I64, _I64, _P]),
    "rim_fill_uniform": (
        None,
        [_P, _P, _I64, _I64, _I64, ctypes.c_double, ctypes.c_double, _P, _I64],
    ),
    "rim_step_many": (None, [_I64, *[_P] * 12, _INT]),
}


def _build() -> ctypes.CDLL:
    """Compile the C source (once per source, flags and machine) and load it."""
    return build_library(_C_SOURCE_PATH, [_C_HEADER_PATH], _CFLAGS, _SIGNATURES)


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
    """`recopt.modules.id_map_lookup.hash_uniform` (the same bits) in native code.

    Raises:
        RuntimeError: the library is not available.
    """
    ids_K = ids_K.to(torch.int64).contiguous()
    out = torch.empty(ids_K.numel(), dim, dtype=torch.float64)
    if out.numel():
        library().rim_hash_uniform(ids_K.data_ptr(), ids_K.numel(), step, dim, out.data_ptr())
    return out


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
