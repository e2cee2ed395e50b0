"""fbgemm's table-batched embedding kernel behind recopt's kernel contract.

The CPU build trains with SGD, Adagrad and row-wise Adagrad only, fp32 or fp16 weights
(rounded to nearest) and fp32 state; the CUDA build also with Adam and row-wise Adam
(fbgemm's ADAM / PARTIAL_ROWWISE_ADAM, mapped to SparseAdam's formula and recopt's per-table
``step`` by `fbgemm_steps`) and LAMB and row-wise LAMB (LAMB / PARTIAL_ROWWISE_LAMB, whose
formulas recopt's are; only the step counter is mapped), fp32 or fp16 weights in any
placement (no bf16 on either build). Weight decay only where fbgemm applies it as recopt
does. recopt validates ids itself, so fbgemm's (warn-and-use-row-0) bounds check is off.
Tables rounded stochastically (CUDA) keep recopt's ``rounding_step`` counter, advanced but not
used: fbgemm draws its own.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import BackendDecision, KernelHook
from recopt.kernels.fbgemm_steps import FbgemmSteps
from recopt.kernels.placement import (
    Location,
    combined_cache_load_factor,
    fbgemm_uvm_arguments,
    placement_problems,
)
from recopt.kernels.precision import Precision
from recopt.kernels.registry import OPTIMIZERS, fbgemm_spec_names, optimizer_spec
from recopt.kernels.updates import ROUNDING_STEP, has_rounding_step

# Optimizers fbgemm's CPU build runs (its CUDA build runs more: `fbgemm_spec_names("cuda")`),
# and the dim multiple they need (fbgemm reads rows in vectors of 4 floats).
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
    if not fbgemm_installed():
        build = "fbgemm-gpu" if device.type == "cuda" else "fbgemm-gpu-cpu"
        return [
            f"fbgemm is not installed in this Python (pip install --no-deps {build}==1.8.0, "
            "the build for torch 2.13; setup.cfg); use backend='recopt' or 'auto'"
        ]
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
    supported = fbgemm_spec_names(device.type)
    if optimizer.name not in supported:
        names = ", ".join(repr(t.name) for t in tables)
        problems.append(
            f"tables {names}: fused optimizer {optimizer.name!r} is not supported by the "
            f"fbgemm backend on {device.type} (supported: {sorted(supported)}); use "
            "backend='recopt' or 'auto'"
        )
    else:
        decay = fbgemm_weight_decay_problem(optimizer, device.type)
        problems.extend([decay] if decay else [])
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


@functools.cache
def fbgemm_installed() -> bool:
    """Whether ``fbgemm_gpu`` can be imported here (without importing it: that loads its
    libraries). Without it AUTO runs recopt's kernels and ``backend='fbgemm'`` is refused."""
    return importlib.util.find_spec("fbgemm_gpu") is not None


def fbgemm_weight_decay_problem(optimizer: FusedOptimizerConfig, device_type: str) -> str:
    """Why fbgemm's build for ``device_type`` would not apply ``optimizer.weight_decay`` as
    recopt does (``""`` when it would, or when there is no weight decay).

    fbgemm's codegen takes no weight decay for EXACT_SGD and EXACT_ADAGRAD (it ignores it
    silently on both builds), its 1.8 CPU row-wise Adagrad passes 0, and its Adam decays in
    AdamW's decoupled form where recopt adds an L2 term to the gradient.
    """
    spec = optimizer_spec(optimizer.name)
    decay = optimizer.weight_decay
    if decay == 0.0 or device_type in spec.fbgemm_weight_decay:
        return ""
    fix = "use backend='recopt' or 'auto', or weight_decay=0"
    if spec.fbgemm_decoupled_weight_decay:
        return (
            f"fbgemm's {optimizer.name!r} decays weights decoupled (AdamW's form), recopt's "
            f"adds the L2 term to the gradient (weight_decay={decay}); {fix}"
        )
    return (
        f"fbgemm's {device_type} {optimizer.name!r} ignores weight_decay (weight_decay={decay} "
        f"would not be applied, where recopt applies it); {fix}"
    )


def fbgemm_auto_objections(optimizer: FusedOptimizerConfig, device: torch.device) -> list[str]:
    """Why AUTO does not pick fbgemm although fbgemm can run the tables.

    An explicit ``backend='fbgemm'`` accepts these; AUTO picks recopt's kernel instead, and a
    table that only fbgemm can hold (UVM) must ask for fbgemm explicitly.
    """
    if device.type == "cuda" and optimizer_spec(optimizer.name).fbgemm_zero_direction_nan:
        return [
            f"fbgemm's {optimizer.name!r} writes NaN into a touched row whose update direction "
            "is zero (its trust ratio ||w|| / ||r|| with r = 0, e.g. a zero summed gradient on "
            "a row's first step), where recopt's kernel leaves the row unchanged "
            "(docs/kernels.md); pass backend='fbgemm' to accept that"
        ]
    return []


def fbgemm_precision_problems(
    tables: Sequence[TableSpec], optimizer: FusedOptimizerConfig, device: torch.device
) -> list[str]:
    """What fbgemm lacks of the requested weight and state precision.

    One weights precision per kernel; fp32 state for its sgd/adagrad kernels (its
    ``optimizer_state_dtypes`` is for partial row-wise Adam only); no bf16 weights on either
    build (the CPU forward is not built for them; the CUDA build the GPU hosts run,
    fbgemm-gpu 1.6.0, asserts ``cache_precision bf16 not supported!`` when it builds the
    kernel and has no bf16 case in its training forward); on CPU no stochastic rounding (its
    CPU kernels round to nearest whatever ``stochastic_rounding`` says; measured).
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
    if Precision.BF16 in kinds:
        problems.append(
            f"tables {names}: fbgemm's {device.type} kernels do not run bf16 weights; use "
            "weight_dtype='fp16' or 'fp32', or keep bf16 in device memory (placement "
            f"'device') on backend='recopt' or 'auto'"
        )
    if device.type == "cpu" and Precision.FP16 in kinds and optimizer.stochastic_rounding:
        problems.append(
            f"tables {names}: fbgemm's CPU kernels round fp16 updates to nearest, not "
            f"stochastically; pass stochastic_rounding=False to accept that, or {fix}"
        )
    return problems


def name_fbgemm_states(
    names: Sequence[str],
    per_table: Sequence[Sequence[torch.Tensor]],
    steps: Sequence[torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """fbgemm's per-table states (its order) under recopt's keys, with each table's ``step``.

    The tensors are fbgemm's own views (writing them loads a checkpoint in place); ``step`` is
    recopt's per-table counter, which `FbgemmSteps` maps onto fbgemm's one counter.
    """
    states = [dict(zip(names, table, strict=True)) for table in per_table]
    if steps is not None:
        for state, step in zip(states, steps, strict=True):
            state["step"] = step
    return states


def _fbgemm_locations(on_cuda: bool) -> dict[Location, Any]:
    """fbgemm's ``EmbeddingLocation`` for each of recopt's locations."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    return {
        Location.DEVICE: EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST,
        Location.UVM: EmbeddingLocation.MANAGED,
        Location.UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
    }


def build_fbgemm_tbe(
    tables: Sequence[TableSpec],
    feature_table_map: Sequence[int],
    optimizer: FusedOptimizerConfig,
    pooling: PoolingType,
    device: torch.device,
) -> Any:
    """fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` for tables `fbgemm_problems` passed.

    fbgemm has one HBM cache per kernel, sized by one load factor over its cached tables
    (`combined_cache_load_factor`); on CUDA it draws its own rounding stream (not seeded by
    ``rounding_seed``).
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

    on_cuda = device.type == "cuda"
    compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
    locations = _fbgemm_locations(on_cuda)
    spec = optimizer_spec(optimizer.name)
    fbgemm_name = spec.fbgemm_cuda if on_cuda else spec.fbgemm_cpu
    assert fbgemm_name is not None  # fbgemm_problems checked it
    precision = Precision(tables[0].weight_dtype)
    weights_precision = {Precision.FP32: SparseType.FP32, Precision.FP16: SparseType.FP16}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [
            (t.num_embeddings, t.embedding_dim, locations[t.placement.location], compute)
            for t in tables
        ],
        feature_table_map=list(feature_table_map),
        optimizer=EmbOptimType[fbgemm_name],
        learning_rate=optimizer.learning_rate,
        eps=fbgemm_eps(optimizer),
        beta1=optimizer.betas[0],
        beta2=optimizer.betas[1],
        weight_decay=optimizer.weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if optimizer.weight_decay else WeightDecayMode.NONE,
        pooling_mode=PoolingMode.SUM if pooling == PoolingType.SUM else PoolingMode.MEAN,
        bounds_check_mode=BoundsCheckMode.NONE,
        weights_precision=weights_precision[precision],  # bf16: refused by fbgemm_problems
        stochastic_rounding=precision.reduced and optimizer.stochastic_rounding,
        output_dtype=SparseType.FP32,
        cache_load_factor=combined_cache_load_factor(
            [t.num_embeddings for t in tables], [t.placement for t in tables]
        ),
        device=device,
        # Off-device tables: pinned host memory the GPU reads, not managed memory (which can
        # hang a GPU asked for more than it has free).
        **fbgemm_uvm_arguments(SplitTableBatchedEmbeddingBagsCodegen, tables),
    )
    return tbe


def fbgemm_eps(optimizer: FusedOptimizerConfig) -> float:
    """The ``eps`` fbgemm is built with (recopt's ``eps1``, fbgemm's default when unset)."""
    return 1e-8 if optimizer.eps1 is None else optimizer.eps1


class FbgemmTableBatchedEmbedding(nn.Module):
    """Several tables in one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen``.

    Args:
        tables: the tables, in kernel order.
        feature_table_map: for each input feature, the index of its table.
        optimizer: the fused optimizer (sgd, adagrad or row_wise_adagrad; on CUDA also adam,
            row_wise_adam, lamb and row_wise_lamb); weight decay only where fbgemm applies it
            as recopt does (`fbgemm_weight_decay_problem`).
        pooling: sum or mean.
        device: cpu or cuda.

    Each table's placement maps to fbgemm's ``EmbeddingLocation``: ``device`` to ``DEVICE``
    (``HOST`` on CPU), ``uvm`` to ``MANAGED``, ``uvm_caching`` to ``MANAGED_CACHING`` with the
    kernel's one cache sized by `combined_cache_load_factor`.

    Raises:
        ValueError: the optimizer, an option, the weights' dtype or a table's dim is not
            supported by fbgemm, or a table is placed in UVM on a device other than CUDA.
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
        problems = fbgemm_problems(tables, optimizer, device, feature_table_map)
        problems += placement_problems(tables, device.type)
        if problems:
            raise ValueError("; ".join(problems))
        spec = optimizer_spec(optimizer.name)
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
        self._caching = any(t.placement.location is Location.UVM_CACHING for t in tables)
        self._tbe = build_fbgemm_tbe(tables, feature_table_map, optimizer, pooling, device)
        # fbgemm's CPU backward of a weighted mean bag forgets the mean's 1 / length (its
        # forward divides): `_MeanGradient` divides the gradient it receives instead.
        self._mean_grad_unscaled = pooling == PoolingType.MEAN and device.type == "cpu"
        self._feature_dims = [tables[t].embedding_dim for t in feature_table_map]
        # Stepped optimizers (CUDA Adam, LAMB): recopt's per-table counters, the checkpointed
        # state. recopt's pass counters, so that checkpoints keep the same state keys on both
        # backends (fbgemm's CUDA rounding does not read them).
        self._steps = self._add_step_counters(device) if spec.stepped else None
        precision = Precision(tables[0].weight_dtype)
        self._counts_passes = has_rounding_step(optimizer, precision)
        if self._counts_passes:
            self._add_counters(ROUNDING_STEP, device)

    def _add_counters(self, prefix: str, device: torch.device) -> list[torch.Tensor]:
        """One 0-dim int64 buffer ``_{prefix}_{t}`` per table (not in the state dict: the
        optimizer states carry them)."""
        counters = []
        for t in range(len(self.tables)):
            counter = torch.zeros((), dtype=torch.int64, device=device)
            self.register_buffer(f"_{prefix}_{t}", counter, persistent=False)
            counters.append(counter)
        return counters

    def _add_step_counters(self, device: torch.device) -> FbgemmSteps:
        """The per-table ``step`` buffers and the `FbgemmSteps` that maps them onto fbgemm's
        one counter (it holds no reference to this module: the counters are passed in)."""
        steps = self._add_counters("step", device)
        optimizer = self.optimizer
        return FbgemmSteps(
            steps,
            [t.name for t in self.tables],
            fbgemm_eps(optimizer),
            optimizer.betas[1],
            optimizer_spec(optimizer.name).fbgemm_remap_eps,
        )

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        offset_per_key: Sequence[int] | None = None,
    ) -> torch.Tensor:
        # fbgemm finds each feature's ids on the device: offset_per_key is not needed.
        if self._steps is not None:
            self._steps.before_forward(self._tbe, self._step_tensors())
        out: torch.Tensor = self._tbe(indices, offsets, per_sample_weights=per_sample_weights)
        if self._mean_grad_unscaled and per_sample_weights is not None and out.requires_grad:
            out = _MeanGradient.apply(out, offsets, self._feature_dims)
        if (self._steps is not None or self._counts_passes) and out.requires_grad:
            # Called when the pooled output's gradient arrives, i.e. only for a backward that
            # runs fbgemm's update (a skipped non-finite step leaves the counters alone).
            out.register_hook(self._advance_counters)
        return out

    def _advance_counters(self, grad: torch.Tensor) -> None:
        if self._steps is not None:
            self._steps.after_update(self._step_tensors())
        with torch.no_grad():
            for counter in self._pass_tensors():
                counter.add_(1)  # on the device: nothing is read back

    def _step_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f"_step_{t}") for t in range(len(self.tables))]

    def _pass_tensors(self) -> list[torch.Tensor]:
        if not self._counts_passes:
            return []
        return [getattr(self, f"_{ROUNDING_STEP}_{t}") for t in range(len(self.tables))]

    def split_embedding_weights(self) -> list[torch.Tensor]:
        # Cached tables: the views are of the UVM copy, current only after `flush`.
        return list(self._tbe.split_embedding_weights())

    def flush(self) -> None:
        """Write the HBM cache's rows back to UVM and empty the cache (no cached table: no-op)."""
        if self._caching:
            self._tbe.flush()
            self._tbe.reset_cache_states()

    def split_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        per_table: Sequence[Sequence[torch.Tensor]] = [[] for _ in self.tables]
        if self._state_names:
            per_table = self._tbe.split_optimizer_states()
        steps = self._step_tensors() if self._steps is not None else None
        states = name_fbgemm_states(self._state_names, per_table, steps)
        for state, counter in zip(states, self._pass_tensors(), strict=False):
            state[ROUNDING_STEP] = counter
        return states

    def set_learning_rate(self, lr: float) -> None:
        self._tbe.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return float(self._tbe.get_learning_rate())


class _MeanGradient(torch.autograd.Function):
    """The identity on a pooled output ``[B, sum(dims)]`` whose backward divides each bag's
    gradient by its length (the bags feature-major in ``offsets``, as fbgemm takes them;
    empty bags by 1): what fbgemm's CPU backward of weighted mean bags leaves out, checked
    against autograd in tests/test_fbgemm_weighted_mean.py."""

    @staticmethod
    def forward(ctx: Any, pooled: torch.Tensor, offsets: torch.Tensor, dims: list[int]) -> Any:
        ctx.save_for_backward(offsets)
        ctx.dims = dims
        return pooled.view_as(pooled)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (offsets,) = ctx.saved_tensors
        dims = ctx.dims
        lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(grad.dtype)
        inverse = lengths.reciprocal().view(len(dims), -1).t()  # [B, features]
        widths = torch.tensor(dims, device=grad.device)
        return grad * inverse.repeat_interleave(widths, dim=1, output_size=sum(dims)), None, None
