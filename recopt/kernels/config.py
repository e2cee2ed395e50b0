"""Configuration of table-batched embedding kernels: tables, pooling, fused optimizer.

These frozen dataclasses are shared by the kernels, the modules, the sharding plan and the
planner: one place says which optimizers exist and what state each keeps per table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingType(enum.StrEnum):
    """How the embeddings of one bag are combined."""

    SUM = "sum"
    MEAN = "mean"


class Backend(enum.StrEnum):
    """Which implementation runs a fused table: chosen per optimizer and table shape."""

    AUTO = "auto"
    FBGEMM = "fbgemm"
    RECOPT = "recopt"


# Fused optimizers, and the number of float32 state values each keeps for a table of
# `rows` x `dim`. The planner's storage estimator and the docs read this table.
OPTIMIZER_STATE_FLOATS: dict[str, str] = {
    "sgd": "0",
    "adagrad": "rows * dim",
    "row_wise_adagrad": "rows",
    "adam": "2 * rows * dim",
    "row_wise_adam": "rows * dim + rows",
    "adafactor": "rows + dim",
}


def optimizer_state_floats(name: str, rows: int, dim: int) -> int:
    """Number of float32 optimizer-state values for one table (per-table scalars excluded)."""
    table = {
        "sgd": 0,
        "adagrad": rows * dim,
        "row_wise_adagrad": rows,
        "adam": 2 * rows * dim,
        "row_wise_adam": rows * dim + rows,
        "adafactor": rows + dim,
    }
    if name not in table:
        raise ValueError(f"unknown fused optimizer {name!r}; valid: {sorted(table)}")
    return table[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOptimizerConfig:
    """The optimizer applied to embedding tables inside the backward pass.

    Args:
        name: one of ``sgd``, ``adagrad``, ``row_wise_adagrad``, ``adam``, ``row_wise_adam``,
            ``adafactor``.
        lr: learning rate (Adafactor: the maximum relative step, as in ``torch.optim.Adafactor``).
        eps: term added to denominators (Adafactor: epsilon1, ``None`` for its default).
        weight_decay: L2 penalty (Adam, Adagrad, SGD) / decoupled decay (Adafactor).
        betas: Adam's moment coefficients.
        maximize: ascend instead of descend, where the reference optimizer has the option.
        beta2_decay: Adafactor's beta2 decay exponent.
        eps2: Adafactor's epsilon2 (parameter-scale floor).
        clip_threshold: Adafactor's update clipping threshold ``d``.
        backend: ``auto`` (measured per optimizer and table shape), ``fbgemm`` or ``recopt``.
    """

    name: str = "row_wise_adagrad"
    lr: float = 0.01
    eps: float | None = 1e-8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    maximize: bool = False
    beta2_decay: float = -0.8
    eps2: float = 1e-3
    clip_threshold: float = 1.0
    backend: Backend = Backend.AUTO

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_STATE_FLOATS:
            raise ValueError(
                f"fused optimizer {self.name!r} is unknown; valid: {sorted(OPTIMIZER_STATE_FLOATS)}"
            )
        if not self.lr >= 0.0:
            raise ValueError(f"fused optimizer lr must be >= 0, got {self.lr}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"fused optimizer weight_decay must be >= 0, got {self.weight_decay}")
        object.__setattr__(self, "backend", Backend(self.backend))


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """One table as a kernel sees it (a whole table, or one shard of it)."""

    name: str
    num_embeddings: int
    embedding_dim: int


def validate_kernel_layout(tables: list[TableSpec], feature_table_map: list[int]) -> None:
    """Check a kernel's tables and feature-to-table map, whichever backend will run them.

    Raises:
        ValueError: no tables, an empty table, no features, or a feature mapped to no table.
    """
    if not tables:
        raise ValueError("tables is empty; a kernel needs at least one TableSpec")
    for table in tables:
        if table.num_embeddings <= 0 or table.embedding_dim <= 0:
            raise ValueError(
                f"table {table.name!r}: num_embeddings {table.num_embeddings} and "
                f"embedding_dim {table.embedding_dim} must both be >= 1"
            )
    if not feature_table_map:
        raise ValueError("feature_table_map is empty; map at least one feature to a table")
    for feature, t in enumerate(feature_table_map):
        if not 0 <= t < len(tables):
            raise ValueError(
                f"feature_table_map[{feature}] = {t} is not a table index in [0, {len(tables)}); "
                "map every feature to one of the kernel's tables"
            )
