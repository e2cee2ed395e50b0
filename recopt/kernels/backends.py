"""The kernel class of each backend: the one table that maps a `Backend` to its implementation.

`factory.create_kernel` and AUTO's probes (`autotune.probe_samplers`) build kernels through
`kernel_class`; a backend without an entry is an error there, not another backend's kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import Kernel
from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

# (tables, feature_table_map, optimizer, pooling, device) -> a kernel (`Kernel` contract).
KernelClass = Callable[
    [list[TableSpec], list[int], FusedOptimizerConfig, PoolingType, torch.device], Kernel
]

KERNEL_CLASSES: dict[Backend, KernelClass] = {
    Backend.FBGEMM: FbgemmTableBatchedEmbedding,
    Backend.RECOPT: RecoptTableBatchedEmbedding,
}


def kernel_class(backend: Backend) -> KernelClass:
    """The class implementing ``backend``'s kernels.

    Raises:
        ValueError: ``backend`` has no kernel class (``auto`` is resolved before this).
    """
    cls = KERNEL_CLASSES.get(Backend(backend))
    if cls is None:
        known = sorted(b.value for b in KERNEL_CLASSES)
        raise ValueError(
            f"backend {Backend(backend).value!r} has no kernel class; known: {known} (a new "
            "backend needs its entry in recopt/kernels/backends.py)"
        )
    return cls
