"""Native CPU passes of the recopt kernel: pooling, and gradient aggregation fused with the update.

A small C library (no torch headers: it compiles in about a second) built with the system C
compiler at first use and cached; it works on raw float32 pointers with torch's OpenMP
threads. Backward turns occurrences into sorted (key, gradient offset) words, then each
thread walks whole runs of equal keys, sums their scaled gradient rows into a D-float buffer
and updates that row and its state in place: no [U, D] temporary (fp16 / bf16 weights and
state rows are updated in float32 and rounded back: cpu_round.h). Without a compiler,
`available()` is False and the backend uses `updates.apply_update` (same formulas).
Legend: N occurrences (ids) of all the kernel's tables, D a table's dim, T tables.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from recopt.kernels.native_build import LazyLibrary, build_library
from recopt.kernels.native_build import address as _ptr

logger = logging.getLogger(__name__)

# The C source and its rounding header ship as package data beside this file (setup.cfg).
_C_SOURCE_PATH = Path(__file__).with_name("cpu_fused.c")
_C_HEADER_PATH = Path(__file__).with_name("cpu_round.h")

_CFLAGS = ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp"]


def _build(march: str = "native") -> ctypes.CDLL:
    """Compile the C source (once per source, flags and machine) and load it.

    Args:
        march: the compiler's ``-march``: ``native`` uses what this CPU has (AVX-512, AVX2 +
            F16C); the tests also build ``x86-64`` (no vector extensions) and ``x86-64-v3``.
    """
    ptr, i64, i32, ok = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int
    signatures: dict[str, tuple[type | None, list[type]]] = {
        "recopt_prepare": (ok, [i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i64, ptr, ptr, i32]),
        "recopt_sort": (ok, [i64, ptr, ptr, ptr, ptr, i32, i32]),
        "recopt_pool": (ok, [i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i64, ptr, i32]),
        "recopt_aggregate": (ok, [i64, ptr, ptr, ptr, ptr, i64, ptr, i32]),
        "recopt_fused_update": (ok, [i32, i32, i64, ptr, ptr, ptr, i32, ptr, ptr, i32]),
        "recopt_round": (ok, [i64, ptr, ptr, i32, i32, ctypes.c_uint64, i32]),
    }
    flags = [*_CFLAGS, f"-march={march}"]
    return build_library(_C_SOURCE_PATH, [_C_HEADER_PATH], flags, signatures)


_native = LazyLibrary("native CPU kernel", _build)


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    return _native.available()


def pool(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    mean: bool,
    batch: int,
    feature_tables: list[torch.Tensor],
    feature_col: torch.Tensor,
    out_dim: int,
) -> torch.Tensor:
    """Pooled ``[B, out_dim]`` output of every feature's bags (sum, or mean with ``mean``).

    Args:
        indices: int64 ids (KJT layout), contiguous.
        offsets: int64 ``[F*B + 1]`` bag boundaries, contiguous.
        weights: float32 per-sample weights, or None.
        mean: divide each bag by its length (empty bags give zeros either way).
        batch: B.
        feature_tables: per feature, its table's contiguous ``[R, D]`` weights (float32,
            float16 or bfloat16: rows are summed in float32).
        feature_col: int64 ``[F]``, first output column of each feature.
        out_dim: output width (sum of the features' dims).

    Returns:
        The pooled output.

    Raises:
        RuntimeError: the native library is not available.
    """
    library = _native.get("pool")
    out = torch.empty(batch, out_dim, dtype=torch.float32)
    meta = [_ptr(w) or 0 for w in feature_tables] + [w.shape[1] for w in feature_tables]
    meta += [weight_kind(w.dtype) for w in feature_tables]
    meta_t = torch.tensor(meta, dtype=torch.int64)
    library.recopt_pool(
        offsets.numel() - 1,
        batch,
        _ptr(offsets),
        _ptr(indices),
        _ptr(weights),
        int(mean),
        _ptr(meta_t),
        _ptr(feature_col),
        out_dim,
        _ptr(out),
        torch.get_num_threads(),
    )
    return out


def prepare_sorted(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    mean: bool,
    batch: int,
    feature_base: torch.Tensor,
    feature_col: torch.Tensor,
    out_dim: int,
    num_keys: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every occurrence as one word (key << 32 | gradient-row offset), sorted by key.

    Args:
        indices: int64 ids (KJT layout), contiguous.
        offsets: int64 ``[F*B + 1]`` bag boundaries, contiguous.
        weights: float32 per-sample weights, or None.
        mean: mean pooling (scale by 1/bag length).
        batch: B.
        feature_base: int64 ``[F]``, key offset of each feature's table.
        feature_col: int64 ``[F]``, first grad_out column of each feature.
        out_dim: grad_out's row width.
        num_keys: total rows of all tables (keys are below it); under 2**32.

    Returns:
        ``words_N`` (int64 storage of the unsigned words) and ``scale_N`` (the per-sample
        weight times 1/length for mean pooling; None when all ones), in sorted order.

    Raises:
        RuntimeError: the native library is not available.
    """
    library = _native.get("prepare_sorted")
    n = indices.numel()
    words = torch.empty(n, dtype=torch.int64)
    scale = torch.empty(n, dtype=torch.float32) if weights is not None or mean else None
    threads = torch.get_num_threads()
    library.recopt_prepare(
        offsets.numel() - 1,
        batch,
        _ptr(offsets),
        _ptr(indices),
        _ptr(weights),
        int(mean),
        _ptr(feature_base),
        _ptr(feature_col),
        out_dim,
        _ptr(words),
        _ptr(scale),
        threads,
    )
    tmp_words = torch.empty_like(words)
    tmp_scale = None if scale is None else torch.empty_like(scale)
    key_bits = max(1, (num_keys - 1).bit_length())
    in_tmp = library.recopt_sort(
        n, _ptr(words), _ptr(scale), _ptr(tmp_words), _ptr(tmp_scale), key_bits, threads
    )
    return (tmp_words, tmp_scale) if in_tmp else (words, scale)


def aggregate(
    words_N: torch.Tensor,
    scale_N: torch.Tensor | None,
    grad: torch.Tensor,
    starts_U: torch.Tensor,
    dim: int,
) -> torch.Tensor:
    """Summed, scaled gradient rows of runs of equal keys in `prepare_sorted`'s words.

    Args:
        words_N: sorted words (a slice of `prepare_sorted`'s output, contiguous).
        scale_N: their scales, or None for 1.
        grad: the pooled-output gradient, contiguous float32.
        starts_U: int64 ``[U + 1]``: run u is ``words_N[starts_U[u] : starts_U[u + 1]]``.
        dim: D of the runs' table.

    Returns:
        ``[U, D]`` gradient per run (per touched row, in key order).

    Raises:
        RuntimeError: the native library is not available.
    """
    library = _native.get("aggregate")
    num_runs = starts_U.numel() - 1
    out = torch.empty(num_runs, dim, dtype=torch.float32)
    library.recopt_aggregate(
        num_runs,
        _ptr(starts_U),
        _ptr(words_N),
        _ptr(scale_N),
        _ptr(grad),
        dim,
        _ptr(out),
        torch.get_num_threads(),
    )
    return out


# The C passes' storage kinds (cpu_round.h): float16 / bfloat16 rows are updated in float32
# and rounded back. The one place the codes are written on the Python side.
_STORAGE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def weight_kind(dtype: torch.dtype) -> int:
    """The C pass's code of a storage dtype (0 float32, 1 float16, 2 bfloat16).

    Raises:
        ValueError: another dtype.
    """
    if dtype not in _STORAGE_KINDS:
        raise ValueError(f"the native CPU pass stores float32, float16 or bfloat16, not {dtype}")
    return _STORAGE_KINDS[dtype]


TableTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _slot_meta(weight: torch.Tensor, slot: torch.Tensor | None) -> tuple[int, int, int]:
    """(address, values a row, storage kind) of a table's weights or one state tensor; zeros
    for a state the optimizer lacks. The widths come from the tensors (the registry's state
    shapes), so the C source holds no table of them.

    Raises:
        ValueError: a tensor that is not contiguous or has not one row per weight row.
    """
    if slot is None:
        return 0, 0, 0
    rows = weight.shape[0]
    if not slot.is_contiguous() or slot.dim() not in (1, 2) or slot.shape[0] != rows:
        raise ValueError(
            f"fused_update: a state tensor of shape {tuple(slot.shape)} for a table of {rows} "
            "rows; the native pass needs contiguous [rows] or [rows, dim] state"
        )
    return _ptr(slot) or 0, 1 if slot.dim() == 1 else slot.shape[1], weight_kind(slot.dtype)


def fused_update(
    code: int,
    words_N: torch.Tensor,
    scale_N: torch.Tensor | None,
    grad: torch.Tensor,
    bases: list[int],
    tables: list[TableTensors],
    hyper: list[float],
    step_sizes: list[float],
    seed: int = 0,
    *,
    stochastic: bool = True,
) -> None:
    """Aggregate the gradient of every touched row of every table, update rows and state.

    Args:
        code: the optimizer's code in the C source (`OptimizerSpec.c_code`).
        words_N: the occurrences from `prepare_sorted`: table ``t``'s row ``r`` has key
            ``bases[t] + r``.
        scale_N: per sorted occurrence, the factor on its gradient, or None for 1.
        grad: the pooled-output gradient, contiguous float32.
        bases: ``T + 1`` key offsets of the tables (cumulative row counts).
        tables: per table, contiguous ``[R, D]`` weights and its first and second state
            tensors (``[R, D]`` or ``[R]``, or None), all updated in place. Each is float32,
            or float16 / bfloat16 (the touched rows updated in float32 and rounded back).
        hyper: lr, eps, weight_decay, sign (-1 to maximize), 1 - beta1, 1 - beta2 (the
            differences taken in double, as torch's optimizers do).
        step_sizes: per table, Adam's bias-corrected step size (0 for other optimizers).
        seed: the stochastic rounding seed of this pass (element (key, slot, column) hashes
            it), below 2^63.
        stochastic: round float16 / bfloat16 values stochastically; False rounds them to
            nearest even (``seed`` is then unused).

    Raises:
        RuntimeError: the native library is not available.
        ValueError: a dtype the pass does not store, a state tensor not shaped by rows, an
            optimizer without the state its code needs, or state of another width than its
            code updates (which would be written past its rows).
    """
    library = _native.get("fused_update")
    meta = list(bases)
    for slot in range(3):  # per slot: addresses [T], values a row [T], storage kinds [T]
        columns = zip(*(_slot_meta(tensors[0], tensors[slot]) for tensors in tables), strict=True)
        for column in columns:
            meta += column
    meta.append(seed)
    meta_t = torch.tensor(meta, dtype=torch.int64)
    hyper_t = torch.tensor(hyper + step_sizes, dtype=torch.float32)
    status = library.recopt_fused_update(
        code,
        int(stochastic),
        words_N.numel(),
        _ptr(words_N),
        _ptr(scale_N),
        _ptr(grad),
        len(tables),
        _ptr(meta_t),
        _ptr(hyper_t),
        torch.get_num_threads(),
    )
    if status == -1:
        raise ValueError(
            f"fused_update: optimizer code {code} has no case in update_row of "
            "recopt/kernels/cpu_fused.c; add one there, or set the spec's c_code=None so its "
            "CPU tables take the torch update"
        )
    if status == -2:
        raise ValueError(f"fused_update: optimizer code {code} needs state tensors not passed")
    if status != 0:
        widths = [[_slot_meta(t[0], t[s])[1] for s in (1, 2)] for t in tables]
        raise ValueError(
            f"fused_update: optimizer code {code} got state of {widths} values a row for tables "
            f"of dims {[t[0].shape[1] for t in tables]}; its state is per element ([rows, dim]) "
            "or per row ([rows]) as its registry spec says"
        )


def round_to(x: torch.Tensor, dtype: torch.dtype, seed: int | None) -> torch.Tensor:
    """Float32 ``x`` rounded to fp16 or bf16: stochastically, or to nearest even.

    Stochastic rounding follows recopt.kernels.precision's law; element i's random bits are a
    hash of ``(seed, i)``, so the result depends on the seed only, not on the thread count.
    Rounding to nearest even equals torch's ``x.to(dtype)``.

    Args:
        x: float32 values.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        seed: the stochastic rounding seed, or None to round to nearest even.

    Raises:
        RuntimeError: the native library is not available.
        ValueError: ``dtype`` is neither fp16 nor bf16.
    """
    library = _native.get("round_to")
    kind = weight_kind(dtype)
    if kind == 0:
        raise ValueError(f"round_to: dtype {dtype} is not rounded to; use float16 or bfloat16")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    library.recopt_round(
        x.numel(),
        _ptr(x),
        _ptr(out),
        kind,
        int(seed is not None),
        (seed or 0) % 2**64,
        torch.get_num_threads(),
    )
    return out


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`round_to` stochastically: float32 ``x`` to fp16 or bf16 with ``seed`` (precision's law).

    Raises:
        RuntimeError: the native library is not available.
        ValueError: ``dtype`` is neither fp16 nor bf16.
    """
    return round_to(x, dtype, seed)
