"""recopt's own table-batched embedding kernel, the optimizer fused into backward.

On CPU forward and backward are native passes (`cpu_fused`): one sort of all the tables'
ids, then one pass that sums each touched row's gradient and updates only that row and its
state (fp16/bf16 weights and state in float32, rounded back stochastically or to nearest).
Otherwise (hooks, Adafactor, other devices) torch ops do the same per table; reduced
precision is computed in fp32 and rounded back. Stochastic rounding depends on the kernel's
seed and its checkpointed pass counter only. This file holds the module and
the choice of path; the backward passes themselves are in `recopt_backward`.
Legend: B batch, F features, N ids (occurrences) of one table, D a table's dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recopt.kernels import cpu_fused, recopt_backward, registry, updates
from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    validate_kernel_layout,
)
from recopt.kernels.contract import BackendDecision, KernelHook
from recopt.kernels.placement import placed_off_device
from recopt.kernels.precision import Precision, RoundingStream, rounding_seed
from recopt.kernels.steps import StepMirror

Tensor = torch.Tensor


class RecoptTableBatchedEmbedding(nn.Module):
    """Several embedding tables pooled in one module, the optimizer applied in backward.

    Implements the kernel contract of docs/design.md ("Embedding kernels"). Example: two
    tables, three features (``f0`` and ``f2`` share table 0), batch 2::

        kernel = RecoptTableBatchedEmbedding(
            [TableSpec(name="t0", num_embeddings=10, embedding_dim=4),
             TableSpec(name="t1", num_embeddings=5, embedding_dim=8)],
            [0, 1, 0], FusedOptimizerConfig(), PoolingType.SUM, torch.device("cpu"))
        out = kernel(indices, offsets)   # [2, 4 + 8 + 4]; offsets has 3 * 2 + 1 entries
        out.sum().backward()             # updates the touched rows of t0 and t1

    Args:
        tables: the tables, in kernel order.
        feature_table_map: for each feature, the index of its table.
        optimizer: the fused optimizer and its hyperparameters.
        pooling: sum or mean for every feature.
        device: where the weights and state live.
        use_native: run the native CPU pass when it is available (CPU tables, float32,
            fp16 or bf16); False forces the torch-ops path.

    Tables keep their ``weight_dtype`` and the state ``optimizer.state_dtype``; pooled
    outputs are float32 whatever the tables' dtype (rows are summed in float32). Tables
    rounded stochastically also keep a ``rounding_step`` pass counter in their state: a
    pass's rounding depends on the kernel's seed and that count only, so state loaded in
    place (a checkpoint) continues exactly as the run that saved it.

    Raises:
        ValueError: empty tables, a table with no rows or dim, a feature mapped to no table,
            adafactor with fp16/bf16 weights, or a table placed in UVM (only fbgemm's CUDA
            kernel reads UVM).
    """

    def __init__(
        self,
        tables: list[TableSpec],
        feature_table_map: list[int],
        optimizer: FusedOptimizerConfig,
        pooling: PoolingType,
        device: torch.device,
        *,
        use_native: bool = True,
    ) -> None:
        super().__init__()
        validate_kernel_layout(tables, feature_table_map)
        off_device = placed_off_device(tables)
        if off_device:
            raise ValueError(
                f"tables {off_device}: recopt's kernel keeps every table in device memory and "
                "cannot read UVM; use backend 'fbgemm' or 'auto' on CUDA, or placement 'device'"
            )
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.optimizer = optimizer
        self._spec = registry.optimizer_spec(optimizer.name)
        self.pooling = PoolingType(pooling)
        self._lr = optimizer.learning_rate
        device = torch.device(device)
        self._check_precision()
        self.weights = nn.ParameterList([_init_weight(table, device) for table in tables])
        self._reduced = optimizer.state_dtype.reduced or any(
            Precision(t.weight_dtype).reduced for t in tables
        )
        # Tables rounded stochastically count their passes (``rounding_step``, checkpointed);
        # the kernel's stream is a function of its seed (config seed and table names) and
        # that count, so each step rounds differently and a resumed run as an unbroken one.
        counted = [updates.has_rounding_step(optimizer, t.weight_dtype) for t in tables]
        self._rounding: RoundingStream | None = None
        if any(counted):
            seed = rounding_seed(optimizer.rounding_seed, [t.name for t in tables])
            self._rounding = RoundingStream(seed, device)
        self._state_names = self._init_states(device, counted)
        self._norms = [updates.AdafactorNorm() for _ in tables]
        # Host copies of the step and pass counters (fresh state: all zero), so no step reads
        # them back.
        self._steps = StepMirror(self._step_tensors(), [0] * len(tables))
        self._passes = StepMirror(self._pass_tensors(), [0] * len(self._pass_tensors()))
        dims = [tables[t].embedding_dim for t in feature_table_map]
        self._col_offsets = [sum(dims[:f]) for f in range(len(dims))]
        self.output_dim = sum(dims)
        # Native pass: table t's row r is key bases[t] + r in one key space over all tables.
        rows = [table.num_embeddings for table in tables]
        self._table_bases = [sum(rows[:t]) for t in range(len(rows) + 1)]
        self._feature_base = torch.tensor([self._table_bases[t] for t in feature_table_map])
        self._feature_col = torch.tensor(self._col_offsets, dtype=torch.int64)
        self._use_native = use_native
        # Set by fault tolerance (grad_hook) and column-wise sharding (row_stat_hook); either
        # one routes backward through the torch path, which has a point between gradient
        # aggregation and update where they can run.
        self.backend = Backend.RECOPT
        self.supports_hooks = True
        self.backend_decision: BackendDecision | None = None  # set by create_kernel
        self.grad_hook: KernelHook | None = None
        self.row_stat_hook: KernelHook | None = None

    def _init_states(self, device: torch.device, counted: list[bool]) -> list[list[str]]:
        """Zero state of every table as buffers ``_state_<t>_<name>``; its names per table."""
        names: list[list[str]] = []
        for t, table in enumerate(self.tables):
            state = updates.init_state(
                self.optimizer.name,
                table.num_embeddings,
                table.embedding_dim,
                device,
                self.optimizer.state_dtype.dtype,
                rounding_step=counted[t],
            )
            names.append(list(state))
            for name, tensor in state.items():
                self.register_buffer(f"_state_{t}_{name}", tensor, persistent=False)
        return names

    def _check_precision(self) -> None:
        if not self._spec.dense_state:
            return
        for table in self.tables:
            if Precision(table.weight_dtype).reduced:
                raise ValueError(
                    f"table {table.name!r}: weight_dtype {Precision(table.weight_dtype).value!r} "
                    f"with {self.optimizer.name!r}, whose update reads the whole table; use "
                    "weight_dtype='fp32' for adafactor tables"
                )

    # Contract surface ---------------------------------------------------------------------

    def forward(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        offset_per_key: Sequence[int] | None = None,
    ) -> Tensor:
        """Pool every feature's bags.

        Args:
            indices: int64 ids, all of feature 0's bags, then feature 1's, ...
            offsets: ``[F*B + 1]`` bag boundaries into ``indices``.
            per_sample_weights: optional float weight per id (weighted features).
            offset_per_key: ``offsets[f * B]`` for f in 0..F, when the caller knows them on
                the host (a KJT's ``offset_per_key()``); ``None`` reads them from
                ``offsets`` (one device sync per step off the CPU).

        Returns:
            ``[B, sum of each feature's dim]``, features' columns in feature order.

        Raises:
            ValueError: ``offsets`` does not hold F*B+1 entries, or ``offset_per_key`` does
                not hold F+1.
        """
        num_features = len(self.feature_table_map)
        if offsets.dim() != 1 or (offsets.numel() - 1) % num_features != 0:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; it needs F*B+1 with F="
                f"{num_features} features (KJT layout, feature-major)"
            )
        if offset_per_key is not None and len(offset_per_key) != num_features + 1:
            raise ValueError(
                f"offset_per_key has {len(offset_per_key)} entries; it needs F+1 = "
                f"{num_features + 1} (each feature's first id, then the total)"
            )
        bounds = self._feature_bounds(offsets, offset_per_key)
        out: Tensor = recopt_backward.FusedEmbeddingFunction.apply(
            self, indices, offsets, per_sample_weights, bounds, *self.weights
        )
        return out

    def split_embedding_weights(self) -> list[Tensor]:
        """Each table's ``[rows, dim]`` weights: views to read, initialise and load through."""
        return [weight.detach() for weight in self.weights]

    def split_optimizer_states(self) -> list[dict[str, Tensor]]:
        """Each table's optimizer state (names and shapes of docs/design.md), in-place writable."""
        return [
            {name: getattr(self, f"_state_{t}_{name}") for name in names}
            for t, names in enumerate(self._state_names)
        ]

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate used from the next backward on.

        Raises:
            ValueError: ``lr`` is negative.
        """
        if not lr >= 0.0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self._lr = float(lr)

    def get_learning_rate(self) -> float:
        """The learning rate the next backward will use."""
        return self._lr

    def flush(self) -> None:
        """Nothing to write back: every table is in device memory."""

    # Forward and backward passes ------------------------------------------------------------

    def _feature_bounds(
        self, offsets: Tensor, offset_per_key: Sequence[int] | None
    ) -> tuple[int, list[int]]:
        """The batch size and each feature's first id (F+1 entries), host-side."""
        num_features = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // num_features
        if batch == 0:
            return 0, [0] * (num_features + 1)
        if offset_per_key is not None:
            return batch, list(offset_per_key)
        return batch, offsets[::batch].tolist()  # the caller did not know them: one read

    def _pool(
        self,
        indices: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
        bounds: tuple[int, list[int]],
    ) -> Tensor:
        batch, starts = bounds
        mean = self.pooling == PoolingType.MEAN
        if batch > 0 and self._native_ok(None, indices, offsets, weights):
            return cpu_fused.pool(
                indices.contiguous(),
                offsets.contiguous(),
                None if weights is None else weights.contiguous(),
                mean,
                batch,
                [self.weights[t].detach() for t in self.feature_table_map],
                self._feature_col,
                self.output_dim,
            )
        pooled = []
        for f, t in enumerate(self.feature_table_map):
            ids = indices[starts[f] : starts[f + 1]]
            offs = offsets[f * batch : (f + 1) * batch + 1] - starts[f]
            psw = None if weights is None else weights[starts[f] : starts[f + 1]]
            mode = "mean" if mean and psw is None else "sum"
            table = self.weights[t].detach()
            if table.dtype != torch.float32:
                # fp16/bf16 rows are summed in float32: gather them, then pool the copies.
                table = table.index_select(0, ids).float()
                ids = torch.arange(ids.numel(), device=ids.device)
                psw = None if psw is None else psw.float()
            out_B_D = F.embedding_bag(
                ids,
                table,
                offs,
                mode=mode,
                per_sample_weights=psw,
                include_last_offset=True,
            )
            if mean and psw is not None:
                out_B_D = out_B_D / offs.diff().clamp(min=1).unsqueeze(1).to(out_B_D.dtype)
            pooled.append(out_B_D)
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)

    def _advance_steps(self) -> list[int]:
        """Advance every table's step counter; their new values (host copies, no read)."""
        if not self._spec.stepped:
            return [0] * len(self.tables)
        return self._steps.advance(self._step_tensors())

    def _step_tensors(self) -> list[Tensor]:
        if not self._spec.stepped:
            return []
        return [getattr(self, f"_state_{t}_step") for t in range(len(self.tables))]

    def _pass_tensors(self) -> list[Tensor]:
        """The ``rounding_step`` counters of the tables that have one."""
        return [
            getattr(self, f"_state_{t}_{updates.ROUNDING_STEP}")
            for t, names in enumerate(self._state_names)
            if updates.ROUNDING_STEP in names
        ]

    def _begin_rounding_pass(self) -> int:
        """Advance the tables' pass counters and reseed the stream for this pass.

        The pass number is the largest of the counters (they differ only when a checkpoint
        loaded different counts into this kernel's tables; each then advances by one).

        Returns:
            The native pass's seed (0 without stochastic rounding).
        """
        if self._rounding is None:
            return 0
        return self._rounding.begin_pass(max(self._passes.advance(self._pass_tensors())))

    def _apply_optimizer(
        self,
        grad_out: Tensor,
        indices: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
        bounds: tuple[int, list[int]],
    ) -> None:
        """Update every table's touched rows and state from the pooled-output gradient."""
        steps = self._advance_steps()
        seed = self._begin_rounding_pass()
        if self._native_ok(grad_out, indices, offsets, weights):
            recopt_backward.native_update(self, grad_out, indices, offsets, weights, steps, seed)
            return
        sparse_update = self._triton_update_fn(grad_out)
        if sparse_update is not None:
            recopt_backward.triton_update(
                self, sparse_update, grad_out, indices, offsets, weights, bounds, steps
            )
            return
        native_sums = (
            self._native_ok(None, indices, offsets, weights)
            and grad_out.dtype == torch.float32
            and grad_out.numel() < 2**32
        )
        row_grads = (
            recopt_backward.native_row_grads(self, grad_out, indices, offsets, weights)
            if native_sums
            else recopt_backward.torch_row_grads(self, grad_out, indices, offsets, weights, bounds)
        )
        states = self.split_optimizer_states()
        for t, row_grad in enumerate(row_grads):
            weight = self.weights[t].detach()
            if row_grad is None:
                empty = torch.empty(0, dtype=torch.int64, device=weight.device)
                if self.grad_hook is not None:
                    # Called for every table on every backward, even with no rows, so hooks
                    # that run collectives stay in step with their peers.
                    self.grad_hook(t, empty, weight.new_zeros(0, weight.shape[1]))
                if self._spec.dense_state:  # absent rows still decay their stats (adafactor)
                    self._torch_update(
                        t, weight, states[t], empty, weight.new_zeros(0, weight.shape[1]), steps[t]
                    )
                continue
            rows_U, grad_U_D = row_grad
            if self.grad_hook is not None:
                grad_U_D = self.grad_hook(t, rows_U, grad_U_D)
            grad_dtype = torch.float32 if self._reduced else weight.dtype
            self._torch_update(t, weight, states[t], rows_U, grad_U_D.to(grad_dtype), steps[t])

    def _triton_update_fn(self, grad_out: Tensor) -> updates.SparseUpdate | None:
        """Triton's sort-and-update kernel for float32 CUDA tables and state without hooks, if it
        imports (fp16/bf16 weights or state take the torch path, rounded back)."""
        if (
            self.grad_hook is not None
            or self.row_stat_hook is not None
            or not self._spec.triton_update
            or self._reduced
            or grad_out.dtype != torch.float32
            or any(w.device.type != "cuda" or w.dtype != torch.float32 for w in self.weights)
        ):
            return None
        return updates.triton_sparse_update()

    def _torch_update(
        self,
        t: int,
        weight: Tensor,
        state: dict[str, Tensor],
        rows_U: Tensor,
        grad_U_D: Tensor,
        step: int,
    ) -> None:
        hook = self.row_stat_hook
        row_stat = None if hook is None else (lambda sum_sq_U: hook(t, rows_U, sum_sq_U))
        if self._reduced:
            updates.apply_update_rounded(
                self.optimizer,
                self._lr,
                weight,
                state,
                rows_U,
                grad_U_D,
                None if self._rounding is None else self._rounding.generator,
                row_stat,
                step=step,
            )
            return
        updates.apply_update(
            self.optimizer,
            self._lr,
            weight,
            state,
            rows_U,
            grad_U_D,
            self._norms[t],
            row_stat,
            step=step,
        )

    def _native_ok(
        self,
        grad_out: Tensor | None,
        indices: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
    ) -> bool:
        """The native passes run CPU tables (float32, fp16, bf16) with int64 ids (backward:
        and no hooks, an optimizer with a C code; state in any of the three dtypes, rounded
        stochastically or to nearest).

        ``grad_out`` None asks about the forward, which every optimizer and hook can use.
        """
        backward_ok = grad_out is not None and (
            self.grad_hook is None
            and self.row_stat_hook is None
            and self._spec.c_code is not None
            and grad_out.dtype == torch.float32
            and grad_out.numel() < 2**32
        )
        return (
            self._use_native
            and (grad_out is None or backward_ok)
            and all(w.device.type == "cpu" for w in self.weights)
            and indices.device.type == "cpu"
            and indices.dtype == torch.int64
            and offsets.dtype == torch.int64
            and (weights is None or weights.dtype == torch.float32)
            # An occurrence packs its key and gradient offset into 32 bits each.
            and self._table_bases[-1] < 2**32
            and cpu_fused.available()
        )


def _init_weight(table: TableSpec, device: torch.device) -> nn.Parameter:
    """A table's weight, uniform in +-1/sqrt(rows) (torch's draws, in table order)."""
    bound = 1.0 / math.sqrt(table.num_embeddings)
    weight = torch.empty(
        table.num_embeddings,
        table.embedding_dim,
        device=device,
        dtype=Precision(table.weight_dtype).dtype,
    )
    return nn.Parameter(weight.uniform_(-bound, bound))
