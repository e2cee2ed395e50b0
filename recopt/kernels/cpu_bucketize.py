"""The native routing of a rank's ids (cpu_bucketize.c): built with the system C compiler at
first use, like `cpu_id_map`. Without a compiler `available()` is False and
`recopt.sharding.bucketizer.Bucketizer` routes with its torch ops (or fbgemm's pass)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from recopt.kernels.native_build import LazyLibrary, build_library
from recopt.kernels.native_build import address as _ptr

_C_SOURCE_PATH = Path(__file__).with_name("cpu_bucketize.c")
_C_HEADERS = [Path(__file__).with_name("cpu_splitmix.h")]  # included by the source
_CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared"]
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "rb_bucketize": (_I64, [_I64, _I64, _P, _I64, *[_P] * 13, _I64, *[_P] * 5]),
}

_native = LazyLibrary("native bucketization", lambda: build_library(
    _C_SOURCE_PATH, _C_HEADERS, _CFLAGS, _SIGNATURES
))  # fmt: skip


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    return _native.available()


def bucketize(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    tables: dict[str, torch.Tensor],
    num_virtual: int,
    max_routes: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """`rb_bucketize` on CPU tensors: ``lengths`` ``[F x batch]`` and ``values`` ``[N]`` (int64,
    contiguous), ``weights`` ``[N]`` float32 or None; ``tables`` the routing tensors
    (``feature_blocks``, ``block_bounds``, ``feat_base``, ``block_row_offset``,
    ``route_count``, ``route_start``, ``route_gv``, and ``feature_hashed`` (uint8),
    ``hash_shards``, ``hash_base``, ``hash_block`` or those four absent), every one int64 and
    contiguous but the flags. Returns the routed ids and weights grouped by virtual feature and
    the ``[G, B]`` bag lengths; None (nothing routed) when the lengths do not sum to N.

    Raises:
        RuntimeError: the library is not available.
    """
    num_features = tables["feat_base"].numel()
    n = values.numel()
    ids_out = torch.empty(n * max_routes, dtype=torch.int64)
    weights_out = None if weights is None else torch.empty(n * max_routes, dtype=torch.float32)
    lengths_out = torch.empty(num_virtual, batch, dtype=torch.int64)
    next_at = torch.empty(max(num_virtual, 1), dtype=torch.int64)
    hashed = tables.get("feature_hashed")
    hashed_block_at = None if hashed is None else torch.empty(n, dtype=torch.int32)
    routed = _native.get("cpu_bucketize").rb_bucketize(
        num_features, batch, lengths.data_ptr(), n, values.data_ptr(), _ptr(weights),
        tables["feature_blocks"].data_ptr(), tables["block_bounds"].data_ptr(),
        tables["feat_base"].data_ptr(), tables["block_row_offset"].data_ptr(),
        tables["route_count"].data_ptr(), tables["route_start"].data_ptr(),
        tables["route_gv"].data_ptr(), _ptr(hashed), _ptr(tables.get("hash_shards")),
        _ptr(tables.get("hash_base")), _ptr(tables.get("hash_block")), num_virtual,
        next_at.data_ptr(), _ptr(hashed_block_at), ids_out.data_ptr(), _ptr(weights_out),
        lengths_out.data_ptr(),
    )  # fmt: skip
    if routed < 0:
        return None
    routed_weights = None if weights_out is None else weights_out[:routed]
    return ids_out[:routed], routed_weights, lengths_out
