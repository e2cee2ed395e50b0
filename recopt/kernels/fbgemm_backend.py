"""fbgemm's table-batched embedding kernel behind recopt's kernel contract.

The CPU build trains with SGD, Adagrad and row-wise Adagrad only, fp32 or fp16 weights
(rounded to nearest) and fp32 state; the CUDA build is the GPU path. recopt validates ids
itself, so fbgemm's (warn-and-use-row-0) bounds check is off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recopt.kernels.autotune import BackendDecision
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import KernelHook
from recopt.kernels.precision import Precision
from recopt.kernels.registry import OPTIMIZERS, optimizer_spec

# Optimizers fbgemm's fused kernels run here (its CPU build's; the registry also records its
# CUDA names, which this backend does not use yet: their step counter is not mapped), and the
# dim multiple they need (fbgemm reads rows in vectors of 4 floats).
FBGEMM_OPTIMIZERS: frozenset[str] = frozenset(
    spec.name for spec in OPTIMIZERS.values() if spec.fbgemm_cpu is not None
)
FBGEMM_DIM_MULTIPLE = 4


def fbgemm_problems(
    tables: Sequence[TableSpec],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    feature_table_map: Sequence[int] | None = None,
) -> list[str]:
    """Reasons fbgemm cannot run these tables with this optimizer, each naming the fix.

    Args:
        tables: the tables of one kernel.
        optimizer: the fused optimizer.
        device: where the kernel would run.
        feature_table_map: the features' tables, when known (shared tables are checked).

    Returns:
        One message per problem; empty when fbgemm can run them.
    """
    problems: list[str] = []
    spec = optimizer_spec(optimizer.name)
    if device.type == "cpu" and spec.fbgemm_cpu_shared_table_broken and feature_table_map:
        for t, table in enumerate(tables):
            count = list(feature_table_map).count(t)
            if count > 1:
                problems.append(
                    f"table {table.name!r} is looked up by {count} features, and fbgemm's CPU "
                    f"{optimizer.name!r} does not sum a shared row's gradient over features "
                    "(docs/kernels.md); use backend='recopt' or 'auto'"
                )
    if optimizer.name not in FBGEMM_OPTIMIZERS:
        names = ", ".join(repr(t.name) for t in tables)
        problems.append(
            f"tables {names}: fused optimizer {optimizer.name!r} is not supported by the "
            f"fbgemm backend (supported: {sorted(FBGEMM_OPTIMIZERS)}); use backend='recopt' "
            "or 'auto'"
        )
    if optimizer.maximize:
        problems.append(
            "fbgemm has no 'maximize' option; use backend='recopt' or 'auto' (maximize=True)"
        )
    problems.extend(fbgemm_precision_problems(tables, optimizer, device))
    for table in tables:
        if table.embedding_dim % FBGEMM_DIM_MULTIPLE != 0:
            fixed = -(-table.embedding_dim // FBGEMM_DIM_MULTIPLE) * FBGEMM_DIM_MULTIPLE
            problems.append(
                f"table {table.name!r}: embedding_dim {table.embedding_dim} is not a multiple "
                f"of {FBGEMM_DIM_MULTIPLE}, which the fbgemm backend requires; use "
                f"{fixed}, or backend='recopt' or 'auto'"
            )
    return problems


def fbgemm_precision_problems(
    tables: Sequence[TableSpec], optimizer: FusedOptimizerConfig, device: torch.device
) -> list[str]:
    """What fbgemm lacks of the requested weight and state precision (fbgemm-gpu 1.8.0).

    One weights precision per kernel; fp32 state for its sgd/adagrad kernels (its
    ``optimizer_state_dtypes`` is for partial row-wise Adam only); on CPU no bf16 weights
    (its CPU forward is not built for them) and no stochastic rounding (its CPU kernels
    round to nearest whatever ``stochastic_rounding`` says; measured).
    """
    fix = "use backend='recopt' or 'auto'"
    names = ", ".join(repr(t.name) for t in tables)
    kinds = {Precision(t.weight_dtype) for t in tables}
    problems: list[str] = []
    if len(kinds) > 1:
        problems.append(
            f"tables {names} mix weight dtypes {sorted(k.value for k in kinds)} and fbgemm "
            f"holds one per kernel; give them one weight_dtype, or {fix}"
        )
    if optimizer.state_dtype.reduced:
        problems.append(
            f"fbgemm keeps {optimizer.name!r} state in fp32; state_dtype "
            f"{optimizer.state_dtype.value!r} needs recopt's kernel: {fix}"
        )
    if device.type == "cpu":
        if Precision.BF16 in kinds:
            problems.append(
                f"tables {names}: fbgemm's CPU kernels do not run bf16 weights; use "
                f"weight_dtype='fp16', or {fix}"
            )
        if Precision.FP16 in kinds and optimizer.stochastic_rounding:
            problems.append(
                f"tables {names}: fbgemm's CPU kernels round fp16 updates to nearest, not "
                f"stochastically; pass stochastic_rounding=False to accept that, or {fix}"
            )
    return problems


class FbgemmTableBatchedEmbedding(nn.Module):
    """Several tables in one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen``.

    Args:
        tables: the tables, in kernel order.
        feature_table_map: for each input feature, the index of its table.
        optimizer: the fused optimizer (sgd, adagrad or row_wise_adagrad on CPU).
        pooling: sum or mean.
        device: cpu or cuda.

    Raises:
        ValueError: the optimizer, an option or a table's dim is not supported by fbgemm.
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        optimizer: FusedOptimizerConfig,
        pooling: PoolingType,
        device: torch.device,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
            WeightDecayMode,
        )

        problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
        if problems:
            raise ValueError("; ".join(problems))
        on_cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        spec = optimizer_spec(optimizer.name)
        precision = Precision(tables[0].weight_dtype)
        weights_precision = {
            Precision.FP32: SparseType.FP32,
            Precision.FP16: SparseType.FP16,
            Precision.BF16: SparseType.BF16,
        }[precision]
        fbgemm_name = spec.fbgemm_cpu
        assert fbgemm_name is not None  # fbgemm_problems checked it
        self._state_names = spec.fbgemm_states
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.optimizer = optimizer
        self.pooling = pooling
        # fbgemm updates inside its fused backward: no point where the hooks could run.
        self.backend = Backend.FBGEMM
        self.supports_hooks = False
        self.backend_decision: BackendDecision | None = None  # set by create_kernel
        self.grad_hook: KernelHook | None = None
        self.row_stat_hook: KernelHook | None = None
        self._tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_embeddings, t.embedding_dim, location, compute) for t in tables],
            feature_table_map=list(feature_table_map),
            optimizer=EmbOptimType[fbgemm_name],
            learning_rate=optimizer.learning_rate,
            eps=1e-8 if optimizer.eps1 is None else optimizer.eps1,
            weight_decay=optimizer.weight_decay,
            weight_decay_mode=WeightDecayMode.L2
            if optimizer.weight_decay
            else WeightDecayMode.NONE,
            pooling_mode=PoolingMode.SUM if pooling == PoolingType.SUM else PoolingMode.MEAN,
            bounds_check_mode=BoundsCheckMode.NONE,
            weights_precision=weights_precision,
            # On CUDA fbgemm draws its own rounding stream (not seeded by rounding_seed).
            stochastic_rounding=precision.reduced and optimizer.stochastic_rounding,
            output_dtype=SparseType.FP32,
            device=device,
        )

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._tbe(indices, offsets, per_sample_weights=per_sample_weights)

    def split_embedding_weights(self) -> list[torch.Tensor]:
        return list(self._tbe.split_embedding_weights())

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        if not self._state_names:
            return [{} for _ in self.tables]
        per_table = self._tbe.split_optimizer_states()
        return [dict(zip(self._state_names, states, strict=True)) for states in per_table]

    def set_learning_rate(self, lr: float) -> None:
        self._tbe.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return float(self._tbe.get_learning_rate())
