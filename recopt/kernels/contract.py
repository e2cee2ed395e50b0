"""The kernel contract (docs/design.md, "Embedding kernels") as a typing.Protocol.

Every backend (`RecoptTableBatchedEmbedding`, `FbgemmTableBatchedEmbedding`) implements it and
`create_kernel` returns it, so modules, sharding and fault tolerance call kernels through
declared, typed members: no ``setattr``, no backend-private attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.utils.hooks import RemovableHandle

from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec

if TYPE_CHECKING:
    from recopt.kernels.updates import AdafactorNorm, RowStat

Tensor = torch.Tensor
# (table index, unique rows [U] ascending, per-row tensor) -> tensor. ``grad_hook`` gets the
# rows' gradients [U, D] before the update and returns the gradients to apply;
# ``row_stat_hook`` gets each row's sum of squared gradients over the kernel's columns [U]
# and returns the mean over the full row (for row-wise optimizers on column shards).
KernelHook = Callable[[int, Tensor, Tensor], Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendDecision:
    """The backend one kernel runs on, and why.

    Args:
        backend: ``fbgemm`` or ``recopt``.
        reason: ``explicit``, ``pinned``, ``only candidate``, ``measured``, ``cached`` or
            ``shared by rank 0`` (what decided it, with detail).
        seconds: median seconds per probe step by backend name, when measured.
    """

    backend: Backend
    reason: str
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict (the cache and the rank-0 broadcast carry this)."""
        return {"backend": self.backend.value, "reason": self.reason, "seconds": dict(self.seconds)}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> BackendDecision:
        """Inverse of `to_json`.

        Raises:
            ValueError: not a decision (a corrupt cache entry).
        """
        backend = Backend(str(data["backend"]))
        seconds = data.get("seconds", {})
        if backend is Backend.AUTO or not isinstance(seconds, dict):
            raise ValueError(f"not a backend decision: {data!r}")
        times = {str(k): float(v) for k, v in seconds.items()}
        return cls(backend=backend, reason=str(data.get("reason", "")), seconds=times)


class Kernel(Protocol):
    """Several tables pooled in one module, with the fused optimizer applied in backward.

    Attributes:
        tables: the kernel's tables (whole tables or shards), in kernel order.
        feature_table_map: for each input feature, the index of its table.
        optimizer: the fused optimizer and its hyperparameters.
        pooling: sum or mean.
        backend: which implementation this is (``Backend.FBGEMM`` or ``Backend.RECOPT``).
        supports_hooks: whether backward calls ``grad_hook`` / ``row_stat_hook`` (recopt's
            kernel; fbgemm's fused kernel has no point between aggregation and update).
        grad_hook: called per table on every backward, also with no rows; ``None``: off.
        row_stat_hook: the full-row statistic of row-wise optimizers; ``None``: off.
        backend_decision: how ``create_kernel`` chose ``backend`` (reason, measured times);
            ``None`` for a kernel built directly.
    """

    tables: list[TableSpec]
    feature_table_map: list[int]
    optimizer: FusedOptimizerConfig
    pooling: PoolingType
    backend: Backend
    supports_hooks: bool
    grad_hook: KernelHook | None
    row_stat_hook: KernelHook | None
    backend_decision: BackendDecision | None

    def __call__(
        self,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None = None,
        offset_per_key: Sequence[int] | None = None,
    ) -> Tensor:
        """Pooled outputs ``[B, sum of the features' dims]``, features in map order.

        ``offset_per_key`` (F+1 host ints, ``offsets[f * B]``): the features' id bounds when
        the caller knows them, so a backend that needs them reads nothing back; optional.
        """
        ...

    def split_embedding_weights(self) -> list[Tensor]:
        """Each table's ``[rows, dim]`` weight, a view of the kernel's storage."""
        ...

    def split_optimizer_states(self) -> list[dict[str, Tensor]]:
        """Each table's optimizer state (registry state keys), views of the kernel's storage."""
        ...

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next backward."""
        ...

    def get_learning_rate(self) -> float:
        """The learning rate the next backward uses."""
        ...

    def flush(self) -> None:
        """Write cached rows back to the table's storage and empty the cache (UVM caching), so
        that the views of ``split_embedding_weights`` are current and writes into them are not
        shadowed by stale cached rows; a no-op for tables in device memory."""
        ...

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``nn.Module``'s: ``hook(kernel, args)`` runs before each forward."""
        ...


@runtime_checkable
class KernelOwner(Protocol):
    """A module that runs its tables on kernels (both embedding twins)."""

    def kernels(self) -> list[Kernel]:
        """This module's (this rank's) kernels."""
        ...


def flush_kernel_caches(module: torch.nn.Module) -> int:
    """`Kernel.flush` every kernel of every `KernelOwner` in ``module`` (itself included).

    Checkpoint save and load call it, so UVM-cached tables are saved with their latest rows and
    a load is not shadowed by rows cached before it.

    Returns:
        The number of kernels flushed.
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, KernelOwner):
            for kernel in sub.kernels():
                kernel.flush()
                count += 1
    return count


# The torch update of one fused optimizer (recopt/kernels/updates.py registers one per spec).
class RowUpdate(Protocol):
    """A row rule: updates the touched rows of one table (and their state) in place."""

    def __call__(
        self,
        config: FusedOptimizerConfig,
        lr: float,
        weight: Tensor,
        state: dict[str, Tensor],
        rows_U: Tensor,
        grad_U_D: Tensor,
        row_stat: RowStat | None = None,
        step: int | None = None,
    ) -> None: ...


class TableUpdate(Protocol):
    """A rule whose statistics span the whole table (`whole_table_statistics`): it also
    reads and keeps the table's running weight norm."""

    def __call__(
        self,
        config: FusedOptimizerConfig,
        lr: float,
        weight: Tensor,
        state: dict[str, Tensor],
        rows_U: Tensor,
        grad_U_D: Tensor,
        norm: AdafactorNorm,
        step: int | None = None,
    ) -> None: ...
