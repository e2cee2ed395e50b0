"""Configuration of table-batched embedding kernels: tables, pooling, fused optimizer.

These frozen dataclasses are shared by the kernels, the modules, the sharding plan and the
planner. Which optimizers exist, their state and defaults: kernels/registry.py.
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass

from recopt.kernels.placement import DEVICE, Placement
from recopt.kernels.precision import Precision, parse_precision
from recopt.kernels.registry import ADAFACTOR, ROW_WISE_ADAGRAD, optimizer_spec


class PoolingType(enum.StrEnum):
    """How the embeddings of one bag are combined."""

    SUM = "sum"
    MEAN = "mean"


class Backend(enum.StrEnum):
    """Which implementation runs a fused table: chosen per optimizer and table shape."""

    AUTO = "auto"
    FBGEMM = "fbgemm"
    RECOPT = "recopt"


def optimizer_state_floats(name: str, rows: int, dim: int) -> int:
    """Number of optimizer-state values for one table (per-table scalars excluded).

    Each takes ``FusedOptimizerConfig.state_dtype``'s bytes (4 for the default fp32).

    Raises:
        ValueError: ``name`` is not a fused optimizer.
    """
    return optimizer_spec(name).state_floats(rows, dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOptimizerConfig:
    """The optimizer applied to embedding tables inside the backward pass.

    Hyperparameters left ``None`` take the reference optimizer's default for ``name``
    (kernels/registry.py), resolved at construction so the config shows the value used.

    Args:
        name: one of ``sgd``, ``adagrad``, ``row_wise_adagrad``, ``adam``, ``row_wise_adam``,
            ``lamb``, ``row_wise_lamb``, ``adafactor``.
        lr: learning rate (Adafactor: the maximum relative step, as in
            ``torch.optim.Adafactor``); ``None``: the optimizer's default (adam 1e-3, as
            ``torch.optim.SparseAdam``; the others 0.01).
        eps: term added to denominators (Adafactor: epsilon1, ``None`` for the dtype's machine
            epsilon). Adafactor also takes torch's ``(eps1, eps2)`` pair. ``None`` elsewhere:
            the default 1e-8.
        weight_decay: L2 penalty (Adam, Adagrad, SGD) / decoupled decay (Adafactor) / the
            ``weight_decay * w`` term of LAMB's update direction (fbgemm's LAMB).
        betas: Adam's and LAMB's moment coefficients, each in [0, 1).
        maximize: ascend instead of descend, where the reference optimizer has the option.
        beta2_decay: Adafactor's beta2 decay exponent (<= 0).
        eps2: Adafactor's epsilon2 (parameter-scale floor).
        clip_threshold: Adafactor's update clipping threshold (>= 1).
        d: torch's name for ``clip_threshold``; folded into it at construction.
        backend: ``auto`` (measured per optimizer and table shape), ``fbgemm`` or ``recopt``.
        state_dtype: how the optimizer state (``momentum1``, ``exp_avg``, ...) is stored:
            ``"fp32"`` (default), ``"fp16"`` or ``"bf16"``; per-table scalars (``step``) stay
            exact int64. Adafactor keeps fp32 state. fp16 covers 6e-8 to 65504 only: squared
            gradients below ~1e-7 (adagrad, adam's second moment) round to 0 and the next
            step divides by eps; bf16 keeps fp32's range (docs/kernels.md).
        stochastic_rounding: round updates into fp16/bf16 weights and state stochastically
            (unbiased; default) rather than to nearest (updates below half a unit in the last
            place are then lost).
        rounding_seed: seed of the rounding stream; each kernel mixes it with its tables'
            names, so runs repeat exactly and kernels (and shards) draw different numbers.

    Raises:
        ValueError: an unknown name or an out-of-range hyperparameter (torch's rules: lr,
            eps1, eps2, weight_decay >= 0, 0 <= betas < 1, beta2_decay <= 0,
            clip_threshold >= 1).
    """

    name: str = ROW_WISE_ADAGRAD.name
    lr: float | None = None
    eps: float | tuple[float | None, float] | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    maximize: bool = False
    beta2_decay: float = -0.8
    eps2: float = 1e-3
    clip_threshold: float = 1.0
    d: float | None = None
    backend: Backend = Backend.AUTO
    state_dtype: Precision = Precision.FP32
    stochastic_rounding: bool = True
    rounding_seed: int = 0

    def __post_init__(self) -> None:
        spec = optimizer_spec(self.name)
        where = f"fused optimizer {self.name!r}: state_dtype"
        object.__setattr__(self, "state_dtype", parse_precision(self.state_dtype, where))
        if self.state_dtype.reduced and spec is ADAFACTOR:
            raise ValueError(
                f"{where} {self.state_dtype.value!r}: adafactor reduces its statistics over the "
                "whole table and keeps them in fp32; use state_dtype='fp32'"
            )
        if self.state_dtype is Precision.FP16 and spec.states:
            warnings.warn(
                f"{where} 'fp16': fp16 flushes values below 6e-8 to 0, i.e. the squared "
                "gradient of every gradient below ~2.4e-4 (Adam's and LAMB's (1 - beta2) * g^2: "
                "below ~8e-3 at beta2=0.999), as embedding gradients often are; the steps then "
                "divide by eps alone. state_dtype='bf16' halves the memory the same way and "
                "keeps fp32's range",
                UserWarning,
                stacklevel=3,
            )
        if isinstance(self.eps, tuple):
            if spec is not ADAFACTOR or len(self.eps) != 2:
                raise ValueError(
                    f"fused optimizer {self.name!r}: eps={self.eps!r} is a pair, which only "
                    "adafactor takes (as (eps1, eps2)); pass one float"
                )
            object.__setattr__(self, "eps2", float(self.eps[1]))
            object.__setattr__(self, "eps", self.eps[0])
        if self.eps is None:
            object.__setattr__(self, "eps", spec.default_eps)
        if self.lr is None:
            object.__setattr__(self, "lr", spec.default_lr)
        if self.d is not None:
            if self.clip_threshold not in (1.0, self.d):
                raise ValueError(
                    f"fused optimizer: d={self.d} and clip_threshold={self.clip_threshold} "
                    "name the same setting; pass one of them"
                )
            object.__setattr__(self, "clip_threshold", float(self.d))
            object.__setattr__(self, "d", None)
        self._validate_betas()
        self._validate()
        object.__setattr__(self, "backend", Backend(self.backend))
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(
                f"fused optimizer {self.name!r}: stochastic_rounding must be true or false, got "
                f"{self.stochastic_rounding!r}"
            )
        if isinstance(self.rounding_seed, bool) or not isinstance(self.rounding_seed, int):
            raise ValueError(
                f"fused optimizer {self.name!r}: rounding_seed must be an int, got "
                f"{self.rounding_seed!r}; e.g. rounding_seed=0"
            )

    def _validate_betas(self) -> None:
        """``betas``: two numbers in [0, 1) (a TOML list becomes the tuple)."""
        betas = self.betas
        ok = (
            isinstance(betas, tuple | list)
            and len(betas) == 2
            and all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas)
        )
        if not ok:
            raise ValueError(
                f"fused optimizer {self.name!r}: betas should be two numbers (beta1, beta2) but "
                f"is {betas!r}; pass e.g. betas=(0.9, 0.999)"
            )
        beta1, beta2 = (float(b) for b in betas)
        for field_name, value in (("betas[0] (beta1)", beta1), ("betas[1] (beta2)", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"fused optimizer {self.name!r}: {field_name} should be in [0, 1) but is "
                    f"{value}; pass a value in [0, 1), e.g. betas=(0.9, 0.999)"
                )
        object.__setattr__(self, "betas", (beta1, beta2))

    def _validate(self) -> None:
        checks = [
            ("lr", self.learning_rate, self.learning_rate >= 0.0, ">= 0"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0.0, ">= 0"),
            ("beta2_decay", self.beta2_decay, self.beta2_decay <= 0.0, "<= 0"),
            ("eps2", self.eps2, self.eps2 >= 0.0, ">= 0"),
            ("clip_threshold (d)", self.clip_threshold, self.clip_threshold >= 1.0, ">= 1"),
        ]
        if self.eps1 is not None:
            checks.append(("eps (eps1)", self.eps1, self.eps1 >= 0.0, ">= 0"))
        for field_name, value, ok, rule in checks:
            if not ok:
                raise ValueError(
                    f"fused optimizer {self.name!r}: {field_name} should be {rule} but is "
                    f"{value}; pass a value {rule}"
                )
            if not math.isfinite(value):  # an inf lr or eps passes its range check
                raise ValueError(
                    f"fused optimizer {self.name!r}: {field_name} should be finite but is "
                    f"{value}; pass a finite value {rule}"
                )

    @property
    def learning_rate(self) -> float:
        """``lr`` as resolved at construction (never ``None``)."""
        return float(self.lr if self.lr is not None else optimizer_spec(self.name).default_lr)

    @property
    def eps1(self) -> float | None:
        """``eps`` as resolved at construction: a float, or ``None`` (Adafactor's dtype eps)."""
        return None if isinstance(self.eps, tuple) else self.eps


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """One table as a kernel sees it (a whole table, or one shard of it).

    ``placement``: where its rows live (kernels/placement.py); anything but ``device`` needs
    fbgemm's CUDA kernel.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    weight_dtype: Precision = Precision.FP32
    placement: Placement = DEVICE


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
