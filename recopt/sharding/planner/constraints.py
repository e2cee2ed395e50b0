"""Per-table constraints and workload hints for the planner.

A constraint limits the options the enumerator may produce for one table (sharding types,
kernels, a minimum column-shard width) and says how the table is used (its fused optimizer,
ids per bag, batch size), which the storage and performance estimators read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.placement import Placement
from recopt.kernels.precision import Precision
from recopt.sharding.plan import ShardingType


class ConstraintError(ValueError):
    """A constraint is malformed or names a table that does not exist."""


def module_label(module: str) -> str:
    """A module path in the planner's messages: quoted, or ``(root)`` for ``""`` as in the
    stats table (an empty quoted name reads as a missing one)."""
    return repr(module) if module else "(root)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterConstraints:
    """What the planner may choose for one table, and how the table is used.

    Args:
        sharding_types: allowed sharding types (``None``: every type; on one host the
            table-row-wise and table-column-wise types, identical there to row-wise and
            column-wise, are left out unless named).
        compute_kernels: allowed kernel backends, in order of preference (``None``: AUTO).
        optimizer: the table's fused optimizer (``None``: the planner's default).
        min_partition: the narrowest column shard column-wise types may cut (default 4,
            fbgemm's width multiple).
        pooling_factor: average ids per bag, per feature of the table.
        batch_size: per-rank batch size for this table (``None``: the planner's).
        placements: where the table may live on a GPU, in order of preference among options of
            equal cost (``None``: the planner chooses among device, UVM caching with the
            topology's ``cache_load_factor``, and UVM; only device on CPU).
        cache_hit_rate: share of lookups the HBM cache serves for a ``uvm_caching`` placement
            (``None``: its cache load factor, as for ids spread evenly over rows; skewed ids
            hit more, e.g. from fbgemm's cache statistics).
    """

    sharding_types: tuple[ShardingType, ...] | None = None
    compute_kernels: tuple[Backend, ...] | None = None
    optimizer: FusedOptimizerConfig | None = None
    min_partition: int = 4
    pooling_factor: float = 1.0
    batch_size: int | None = None
    placements: tuple[Placement, ...] | None = None
    cache_hit_rate: float | None = None

    def __post_init__(self) -> None:
        try:
            if self.sharding_types is not None:
                types = tuple(ShardingType(t) for t in self.sharding_types)
                object.__setattr__(self, "sharding_types", types)
            if self.compute_kernels is not None:
                kernels = tuple(Backend(k) for k in self.compute_kernels)
                object.__setattr__(self, "compute_kernels", kernels)
        except ValueError as e:
            raise ConstraintError(
                f"constraint: {e}; sharding types: {[t.value for t in ShardingType]}, "
                f"kernels: {[k.value for k in Backend]}"
            ) from e
        if self.sharding_types == () or self.compute_kernels == ():
            raise ConstraintError("constraint: an empty list allows nothing; omit the key instead")
        if not isinstance(self.min_partition, int) or self.min_partition < 1:
            raise ConstraintError(
                f"constraint min_partition must be >= 1, got {self.min_partition}"
            )
        if not self.pooling_factor > 0.0:
            raise ConstraintError(
                f"constraint pooling_factor must be > 0, got {self.pooling_factor}"
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ConstraintError(f"constraint batch_size must be >= 1, got {self.batch_size}")
        self._check_placements()

    def _check_placements(self) -> None:
        if self.placements is not None:
            placements = tuple(self.placements)
            if not placements:
                raise ConstraintError(
                    "constraint placements: an empty list allows nothing; omit the key instead"
                )
            for p in placements:
                if not isinstance(p, Placement):
                    raise ConstraintError(
                        f"constraint placements must hold Placement values, got {p!r}; e.g. "
                        "Placement(location='uvm_caching', cache_load_factor=0.2)"
                    )
            object.__setattr__(self, "placements", placements)
        rate = self.cache_hit_rate
        if rate is not None and not (isinstance(rate, int | float) and 0.0 <= rate <= 1.0):
            raise ConstraintError(
                f"constraint cache_hit_rate must be in [0, 1] (share of lookups served by the "
                f"HBM cache), got {rate!r}"
            )


def constraints_from_dict(table: str, values: Mapping[str, Any]) -> ParameterConstraints:
    """Build one table's constraints from a TOML table (``[planner.constraints.<table>]``).

    Raises:
        ConstraintError: unknown keys or bad values, naming the table.
    """
    allowed = set(ParameterConstraints.__dataclass_fields__)
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConstraintError(
            f"constraints for table {table!r}: unknown keys {unknown}; valid: {sorted(allowed)}"
        )
    kw = dict(values)
    try:
        if "optimizer" in kw:
            kw["optimizer"] = optimizer_from_dict(kw["optimizer"], f"table {table!r} optimizer")
        for key in ("sharding_types", "compute_kernels"):
            if key in kw:
                kw[key] = tuple(kw[key])
        if "placements" in kw:
            kw["placements"] = tuple(placement_from_value(p) for p in kw["placements"])
        return ParameterConstraints(**kw)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"constraints for table {table!r}: {e}") from e


def placement_from_value(value: Any) -> Placement:
    """A `Placement` from TOML: a location string (``"uvm"``) or a table of its fields
    (``{location = "uvm_caching", cache_load_factor = 0.1}``).

    Raises:
        ValueError: an unknown location or field, or a bad load factor.
    """
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        return Placement(location=value)  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"location", "cache_load_factor"})
        if unknown:
            raise ValueError(
                f"placement: unknown keys {unknown}; valid: ['cache_load_factor', 'location']"
            )
        return Placement(**value)
    raise ValueError(
        f'placement must be a location string or a table, got {value!r}; e.g. "uvm" or '
        '{location = "uvm_caching", cache_load_factor = 0.2}'
    )


def optimizer_from_dict(values: Any, where: str) -> FusedOptimizerConfig:
    """A `FusedOptimizerConfig` from a TOML table, with unknown keys named.

    Raises:
        ConstraintError: unknown keys or invalid values.
    """
    if not isinstance(values, Mapping):
        raise ConstraintError(f"{where}: expected a table of FusedOptimizerConfig fields")
    allowed = set(FusedOptimizerConfig.__dataclass_fields__)
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConstraintError(f"{where}: unknown keys {unknown}; valid: {sorted(allowed)}")
    kw = dict(values)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    try:
        return FusedOptimizerConfig(**kw)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"{where}: {e}") from e


def resolve_constraints(
    constraints: Mapping[str, ParameterConstraints] | None,
    tables_by_module: Mapping[str, Sequence[Any]],
) -> dict[tuple[str, str], ParameterConstraints]:
    """Match constraint keys to tables: ``"table"`` (any module) or ``"module.path.table"``.

    A module-qualified key wins over a bare table name.

    Returns:
        (module path, table name) -> constraints, for the tables that have any.

    Raises:
        ConstraintError: a key that matches no table.
    """
    result: dict[tuple[str, str], ParameterConstraints] = {}
    if not constraints:
        return result
    by_name: dict[str, list[tuple[str, str]]] = {}
    for module, tables in tables_by_module.items():
        for t in tables:
            by_name.setdefault(t.name, []).append((module, t.name))
    qualified = {(f"{m}.{n}" if m else n): (m, n) for keys in by_name.values() for m, n in keys}
    for key, c in constraints.items():
        if key not in by_name and key not in qualified:
            raise ConstraintError(
                f"constraints name table {key!r}, which no module has; tables: "
                f"{sorted(qualified)[:20]}"
            )
        for target in by_name.get(key, []):
            result.setdefault(target, c)
    for key, c in constraints.items():
        if key in qualified and key not in by_name:
            result[qualified[key]] = c
    return result


@dataclass(frozen=True, kw_only=True, slots=True)
class TableWorkload:
    """How one table is used in a step, as the storage and performance estimators need it.

    Args:
        batch_size: bags per feature per rank in one step.
        num_features: features that look the table up.
        pooling_factor: average ids per bag.
        optimizer: the fused optimizer that will update the table (its ``state_dtype`` sets
            the bytes per state value).
        weight_dtype: how the table's weights are stored (bytes per weight).
        weight_bytes: bytes per stored weight value; 0 (default): ``weight_dtype``'s (4 fp32,
            2 fp16/bf16).
        state_bytes: bytes per stored optimizer-state value; 0 (default): the optimizer's
            ``state_dtype``'s.
        cache_hit_rate: the constraint's, for ``uvm_caching`` placements (``None``: the cache
            load factor).
    """

    batch_size: int
    num_features: int
    pooling_factor: float
    optimizer: FusedOptimizerConfig
    weight_dtype: Precision = Precision.FP32
    weight_bytes: int = 0
    state_bytes: int = 0
    cache_hit_rate: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_dtype", Precision(self.weight_dtype))
        if self.weight_bytes == 0:
            object.__setattr__(self, "weight_bytes", self.weight_dtype.bytes)
        if self.state_bytes == 0:
            object.__setattr__(self, "state_bytes", self.optimizer.state_dtype.bytes)
        if self.weight_bytes < 0 or self.state_bytes < 0:
            raise ValueError(
                f"TableWorkload: weight_bytes {self.weight_bytes} and state_bytes "
                f"{self.state_bytes} must be >= 0 (0: the dtypes' bytes)"
            )
