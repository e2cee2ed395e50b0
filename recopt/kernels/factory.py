"""Backend choice for table-batched embedding kernels: fbgemm's or recopt's own.

`create_kernel` is what modules call; `choose_backend` holds the policy that resolves
`Backend.AUTO`, from the measurements in docs/kernels.md.
"""

from __future__ import annotations

import torch

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    validate_kernel_layout,
)
from recopt.kernels.contract import Kernel
from recopt.kernels.fbgemm_backend import (  # fbgemm itself is imported only when used
    fbgemm_problems,
)
from recopt.kernels.registry import OPTIMIZERS

# CPU policy for AUTO, per optimizer fbgemm's CPU build runs, from the registry's
# `cpu_prefers_fbgemm` (measured with benchmarks/bench_fused_embedding.py, docs/kernels.md).
# Optimizers not listed (and fbgemm's when it cannot run the tables) run on recopt.
CPU_POLICY: dict[str, Backend] = {
    spec.name: Backend.FBGEMM if spec.cpu_prefers_fbgemm else Backend.RECOPT
    for spec in OPTIMIZERS.values()
    if spec.fbgemm_cpu is not None
}


def choose_backend(
    tables: list[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: list[int] | None = None,
) -> Backend:
    """Resolve the backend that runs these tables with this optimizer on this device.

    Policy for ``Backend.AUTO``: on CUDA, fbgemm for what it supports (its GPU kernels are the
    reference there), recopt otherwise; on CPU, the backend ``CPU_POLICY`` names for the
    optimizer (measured, docs/kernels.md) when fbgemm can run the tables, recopt otherwise.

    Args:
        tables: the tables the kernel batches.
        optimizer: the fused optimizer; its ``backend`` field may force a backend.
        device: where the kernel runs.
        feature_table_map: the features' tables, when known (a table shared by several
            features rules out fbgemm's CPU adagrad and row-wise adagrad).

    Returns:
        ``Backend.FBGEMM`` or ``Backend.RECOPT`` (never ``AUTO``).

    Raises:
        ValueError: ``backend='fbgemm'`` was asked for tables or an optimizer fbgemm cannot
            run; the message names the table and the fix.
    """
    device = torch.device(device)
    problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
    if optimizer.backend == Backend.FBGEMM:
        if problems:
            raise ValueError("; ".join(problems))
        return Backend.FBGEMM
    if optimizer.backend == Backend.RECOPT:
        return Backend.RECOPT
    if problems:
        return Backend.RECOPT
    if device.type == "cuda":
        return Backend.FBGEMM
    return CPU_POLICY.get(optimizer.name, Backend.RECOPT)


def create_kernel(
    tables: list[TableSpec],
    feature_table_map: list[int],
    optimizer: FusedOptimizerConfig,
    pooling: PoolingType,
    device: torch.device,
) -> Kernel:
    """Build the kernel that runs these tables, on the backend `choose_backend` picks.

    Args:
        tables: the tables, in kernel order.
        feature_table_map: for each feature (KJT key order), the index of its table.
        optimizer: the fused optimizer (and the requested backend).
        pooling: sum or mean pooling, for every feature of the kernel.
        device: where the weights live and the kernel runs.

    Returns:
        An ``nn.Module`` implementing the `Kernel` contract (kernels/contract.py).

    Raises:
        ValueError: no tables, a feature maps to no table, or a backend that cannot run them.
    """
    validate_kernel_layout(tables, feature_table_map)
    backend = choose_backend(tables, optimizer, torch.device(device), feature_table_map)
    if backend == Backend.FBGEMM:
        from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding

        return FbgemmTableBatchedEmbedding(tables, feature_table_map, optimizer, pooling, device)
    from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

    return RecoptTableBatchedEmbedding(tables, feature_table_map, optimizer, pooling, device)
