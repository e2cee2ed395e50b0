"""The fused optimizers recopt runs, one frozen spec each: the only place that names them.

A spec holds every fact the rest of recopt needs about an optimizer: its state tensors and
their shapes, whether it is row-wise or keeps a step counter, whether its statistics need the
whole table (or whole rows), fbgemm's name for it on CPU and CUDA, the code of its update in
the native CPU kernel, and its reference defaults. Modules, sharding, planner and fault
tolerance read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StateShape(enum.StrEnum):
    """The shape of one optimizer state tensor of a ``rows`` x ``dim`` table."""

    PER_ROW = "per_row"  # [rows]
    PER_ELEMENT = "per_element"  # [rows, dim]
    PER_COLUMN = "per_column"  # [dim]

    def floats(self, rows: int, dim: int) -> int:
        """Number of float32 values of a state of this shape."""
        return {"per_row": rows, "per_element": rows * dim, "per_column": dim}[self.value]

    def size(self, rows: int, dim: int) -> tuple[int, ...]:
        """The tensor shape of a state of this shape."""
        return {"per_row": (rows,), "per_element": (rows, dim), "per_column": (dim,)}[self.value]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """What recopt knows about one fused optimizer.

    Attributes:
        name: the name users pass (``FusedOptimizerConfig.name``).
        states: float32 state tensors (checkpoint key, shape), in order; ``step`` excluded.
        row_wise: one second-moment statistic per row (a column shard needs the full row's).
        stepped: keeps an int64 ``step`` counter (bias correction, a schedule).
        whole_table_statistics: its statistics span every row and every column, so only a
            whole table or a replica can run it (no row or column split).
        full_row_norms: its update scales each row by a ratio of norms over the row's full
            width (LAMB's trust ratio), so no column split can run it (rows may be split).
        weight_decay_in_update: adds ``weight_decay * w`` to its update direction (LAMB's
            form, as fbgemm's kernels do) instead of an L2 term on the gradient.
        dense_state: its state is not indexed by row alone (a per-column statistic), so a
            row-subset update must carry the whole state.
        fbgemm_cpu: fbgemm's ``EmbOptimType`` name in its CPU build, ``None`` if absent.
        fbgemm_cuda: fbgemm's ``EmbOptimType`` name in its CUDA build, ``None`` if absent.
        fbgemm_states: recopt's state keys in the order fbgemm's ``split_optimizer_states``
            returns them, so checkpoints move between backends.
        fbgemm_decoupled_weight_decay: fbgemm's CUDA kernel applies ``weight_decay`` in
            AdamW's decoupled form where recopt adds an L2 term (the fbgemm backend refuses a
            non-zero weight decay).
        fbgemm_weight_decay: the device types whose fbgemm build applies ``weight_decay`` as
            recopt does; elsewhere fbgemm ignores it silently (its codegen takes none for
            EXACT_SGD and EXACT_ADAGRAD; its 1.8 CPU row-wise Adagrad passes 0), so the
            fbgemm backend refuses a non-zero weight decay there.
        fbgemm_zero_direction_nan: fbgemm's kernel writes NaN into a touched row whose update
            direction is zero (LAMB's trust ratio ``||w|| / ||r||`` with ``r = 0``), where
            recopt's leaves the row unchanged: AUTO never picks fbgemm for it (an explicit
            ``backend='fbgemm'`` still runs it).
        fbgemm_remap_eps: fbgemm adds ``eps`` to the bias-corrected root where recopt
            (SparseAdam) adds it to ``sqrt(v)``; `fbgemm_steps` maps it every step. ``False``
            for a stepped optimizer whose formula is fbgemm's own (LAMB).
        fbgemm_cpu_shared_table_broken: fbgemm's CPU kernel mishandles a table shared by
            several features (measured, fbgemm-gpu-cpu 1.8.0: EXACT_ADAGRAD updates once per
            feature, EXACT_ROWWISE_ADAGRAD can raise).
        cpu_prefers_fbgemm: ``Backend.AUTO`` on CPU picks fbgemm when it can run the tables
            (measured, docs/kernels.md: recopt's sgd and adagrad cost half and a quarter of
            fbgemm's CPU time; row-wise adagrad is even or cheaper on fbgemm).
        c_code: the optimizer's code in the native CPU kernel (cpu_fused.c, ``update_row``),
            ``None`` if it has no native update.
        triton_update: recopt's CUDA kernel (triton_sparse.py) has a branch for ``c_code``;
            ``False`` sends CUDA tables to the torch update.
        fp32_state_only: its state must stay float32 (``state_dtype`` fp16/bf16 refused).
        eps_pair: ``eps`` may be a pair ``(eps1, eps2)`` (torch's Adafactor form).
        default_lr: the reference optimizer's default learning rate.
        default_eps: the reference default ``eps`` (``None``: Adafactor's dtype epsilon).
        light_state: keeps at most one float per row (what the planner suggests when memory
            is short).
    """

    name: str
    states: tuple[tuple[str, StateShape], ...]
    row_wise: bool = False
    stepped: bool = False
    whole_table_statistics: bool = False
    full_row_norms: bool = False
    weight_decay_in_update: bool = False
    dense_state: bool = False
    fbgemm_cpu: str | None = None
    fbgemm_cuda: str | None = None
    fbgemm_states: tuple[str, ...] = ()
    fbgemm_decoupled_weight_decay: bool = False
    fbgemm_weight_decay: frozenset[str] = frozenset()
    fbgemm_zero_direction_nan: bool = False
    fbgemm_remap_eps: bool = False
    fbgemm_cpu_shared_table_broken: bool = False
    cpu_prefers_fbgemm: bool = False
    c_code: int | None = None
    triton_update: bool = False
    fp32_state_only: bool = False
    eps_pair: bool = False
    default_lr: float = 0.01
    default_eps: float | None = 1e-8
    light_state: bool = False

    def __post_init__(self) -> None:
        if self.triton_update and self.c_code is None:
            raise ValueError(f"OptimizerSpec {self.name!r}: triton_update needs a c_code")

    def state_floats(self, rows: int, dim: int) -> int:
        """Number of float32 state values for one ``rows`` x ``dim`` table."""
        return sum(shape.floats(rows, dim) for _, shape in self.states)

    def state_formula(self) -> str:
        """The state size as a formula of ``rows`` and ``dim`` (for docs and messages)."""
        terms = {"per_row": "rows", "per_element": "rows * dim", "per_column": "dim"}
        parts = [terms[shape.value] for _, shape in self.states]
        if len(parts) == 2 and parts[0] == parts[1]:
            return f"2 * {parts[0]}"
        return " + ".join(parts) or "0"


SGD = OptimizerSpec(
    name="sgd",
    states=(),
    fbgemm_cpu="EXACT_SGD",
    fbgemm_cuda="EXACT_SGD",
    c_code=0,
    triton_update=True,
    light_state=True,
)
ADAGRAD = OptimizerSpec(
    name="adagrad",
    states=(("momentum1", StateShape.PER_ELEMENT),),
    fbgemm_cpu="EXACT_ADAGRAD",
    fbgemm_cuda="EXACT_ADAGRAD",
    fbgemm_states=("momentum1",),
    fbgemm_cpu_shared_table_broken=True,
    c_code=1,
    triton_update=True,
)
ROW_WISE_ADAGRAD = OptimizerSpec(
    name="row_wise_adagrad",
    states=(("momentum1", StateShape.PER_ROW),),
    row_wise=True,
    fbgemm_cpu="EXACT_ROWWISE_ADAGRAD",
    fbgemm_cuda="EXACT_ROWWISE_ADAGRAD",
    fbgemm_states=("momentum1",),
    fbgemm_weight_decay=frozenset({"cuda"}),  # L2 on CUDA; fbgemm-gpu-cpu 1.8 passes 0
    fbgemm_cpu_shared_table_broken=True,
    cpu_prefers_fbgemm=True,
    c_code=2,
    triton_update=True,
    light_state=True,
)
ADAM = OptimizerSpec(
    name="adam",
    states=(("exp_avg", StateShape.PER_ELEMENT), ("exp_avg_sq", StateShape.PER_ELEMENT)),
    stepped=True,
    fbgemm_cuda="ADAM",
    fbgemm_states=("exp_avg", "exp_avg_sq"),
    fbgemm_decoupled_weight_decay=True,
    fbgemm_remap_eps=True,
    c_code=3,
    triton_update=True,
    default_lr=1e-3,  # torch.optim.SparseAdam's
)
ROW_WISE_ADAM = OptimizerSpec(
    name="row_wise_adam",
    states=(("exp_avg", StateShape.PER_ELEMENT), ("exp_avg_sq", StateShape.PER_ROW)),
    row_wise=True,
    stepped=True,
    fbgemm_cuda="PARTIAL_ROWWISE_ADAM",
    fbgemm_states=("exp_avg", "exp_avg_sq"),
    fbgemm_decoupled_weight_decay=True,
    fbgemm_remap_eps=True,
    c_code=4,
    triton_update=True,
)
# LAMB as fbgemm's CUDA kernels define it (no torch reference exists): Adam's moments with
# eps on the bias-corrected root, weight decay added to the update direction, then each row's
# step scaled by ||w_row|| / ||update_row||. No native or Triton update: the torch path runs.
LAMB = OptimizerSpec(
    name="lamb",
    states=(("exp_avg", StateShape.PER_ELEMENT), ("exp_avg_sq", StateShape.PER_ELEMENT)),
    stepped=True,
    full_row_norms=True,
    weight_decay_in_update=True,
    fbgemm_cuda="LAMB",
    fbgemm_states=("exp_avg", "exp_avg_sq"),
    fbgemm_weight_decay=frozenset({"cuda"}),  # added to the direction, as recopt's
    fbgemm_zero_direction_nan=True,
)
ROW_WISE_LAMB = OptimizerSpec(
    name="row_wise_lamb",
    states=(("exp_avg", StateShape.PER_ELEMENT), ("exp_avg_sq", StateShape.PER_ROW)),
    row_wise=True,
    stepped=True,
    full_row_norms=True,
    weight_decay_in_update=True,
    fbgemm_cuda="PARTIAL_ROWWISE_LAMB",
    fbgemm_states=("exp_avg", "exp_avg_sq"),
    fbgemm_weight_decay=frozenset({"cuda"}),  # added to the direction, as recopt's
    fbgemm_zero_direction_nan=True,
)
ADAFACTOR = OptimizerSpec(
    name="adafactor",
    states=(("row_var", StateShape.PER_ROW), ("col_var", StateShape.PER_COLUMN)),
    stepped=True,
    whole_table_statistics=True,
    dense_state=True,
    fp32_state_only=True,  # its statistics are reduced over the whole table
    eps_pair=True,
    default_eps=None,  # torch.optim.Adafactor's: the machine epsilon of the weights' dtype
)

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        SGD,
        ADAGRAD,
        ROW_WISE_ADAGRAD,
        ADAM,
        ROW_WISE_ADAM,
        LAMB,
        ROW_WISE_LAMB,
        ADAFACTOR,
    )
}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of a fused optimizer.

    Raises:
        ValueError: ``name`` is not a fused optimizer; the message lists the valid names.
    """
    spec = OPTIMIZERS.get(name)
    if spec is None:
        raise ValueError(f"fused optimizer {name!r} is unknown; valid: {sorted(OPTIMIZERS)}")
    return spec


def fbgemm_spec_names(device_type: str) -> frozenset[str]:
    """The optimizers fbgemm's build for ``device_type`` (``cpu`` / ``cuda``) can run."""
    if device_type == "cuda":
        return frozenset(s.name for s in OPTIMIZERS.values() if s.fbgemm_cuda is not None)
    return frozenset(s.name for s in OPTIMIZERS.values() if s.fbgemm_cpu is not None)
