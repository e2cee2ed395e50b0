"""Sharding plan types: where every rectangle of every embedding table lives, and on what kernel.

A plan maps module path -> table name -> `ParameterSharding`, and round-trips exactly through JSON.
It is written by hand (`plan_helpers`: `row_wise()`, `table_wise(3)`, ...) or by the planner, and
checked by `plan_validation.validate_plan` identically on every rank before any collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.placement import DEVICE, Placement
from recopt.sharding.sharding_types import PlanError, ShardingType, ShardSpec, sharding_spec

# The JSON layout version; `from_json` rejects any other so an old reader never half-reads a plan.
PLAN_FORMAT_VERSION = 1


class TableLike(Protocol):
    """What the plan needs from a table (``recopt.modules.EmbeddingBagConfig`` satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def num_embeddings(self) -> int: ...

    @property
    def embedding_dim(self) -> int: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterSharding:
    """How one table is sharded.

    Args:
        sharding_type: the strategy.
        ranks: the ranks holding part of the table, ascending and distinct (DATA_PARALLEL: every
            rank, each holding a full replica).
        shards: the rectangles that tile the table exactly (empty for DATA_PARALLEL). Row-wise
            types put at most one rectangle on a rank; column-wise types may put several.
        backend: the kernel backend of the table's shards (``auto``: the optimizer's
            ``backend``; both set and different is a `PlanError`). Plan files written
            before this name call it ``compute_kernel``; they still load.
        optimizer: the fused optimizer for this table; ``None`` means the module's own.
        placement: where every shard's rows live on its rank (device memory, UVM, or UVM
            with an HBM cache; kernels/placement.py). Anything but ``device`` needs CUDA and
            the fbgemm kernel.
    """

    sharding_type: ShardingType
    ranks: tuple[int, ...]
    shards: tuple[ShardSpec, ...] = ()
    backend: Backend = Backend.AUTO
    optimizer: FusedOptimizerConfig | None = None
    placement: Placement = DEVICE

    def __post_init__(self) -> None:
        # Accept plain strings and lists from hand-written plans; store the canonical forms so
        # equality and JSON round trips do not depend on how the plan was spelled.
        object.__setattr__(self, "sharding_type", sharding_spec(self.sharding_type).sharding_type)
        object.__setattr__(self, "backend", Backend(self.backend))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "shards", tuple(self.shards))
        if isinstance(self.placement, str):  # a location alone: "uvm", "uvm_caching"
            try:
                object.__setattr__(self, "placement", Placement(location=self.placement))
            except ValueError as e:
                raise PlanError(f"ParameterSharding placement: {e}") from None
        if not isinstance(self.placement, Placement):
            raise PlanError(
                f"ParameterSharding placement must be a Placement or a location string, got "
                f"{self.placement!r}; e.g. Placement(location='uvm_caching', cache_load_factor=0.2)"
            )


@dataclass(slots=True)
class ShardingPlan:
    """Module path -> table name -> `ParameterSharding`; the root module's path is ``""``.

    Args:
        plan: the per-module shardings.
    """

    plan: dict[str, dict[str, ParameterSharding]] = field(default_factory=dict)

    def __getitem__(self, module_path: str) -> dict[str, ParameterSharding]:
        return self.plan[module_path]

    def get(self, module_path: str) -> dict[str, ParameterSharding] | None:
        """The shardings of one module's tables, or ``None`` if the plan does not cover it."""
        return self.plan.get(module_path)

    def to_json(self) -> str:
        """Serialize to JSON: enums by value, every optimizer field, modules and tables sorted."""
        body = {
            module: {name: _sharding_to_dict(ps) for name, ps in sorted(tables.items())}
            for module, tables in sorted(self.plan.items())
        }
        return json.dumps({"version": PLAN_FORMAT_VERSION, "plan": body}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Parse `to_json` output.

        Raises:
            PlanError: the text is not a plan of this format, naming the offending field.
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"sharding plan is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(
                f"sharding plan JSON must be an object with version {PLAN_FORMAT_VERSION}; "
                f"got version {doc.get('version') if isinstance(doc, dict) else None!r}"
            )
        _check_keys(doc, {"version", "plan"}, "sharding plan", required={"plan"})
        plan: dict[str, dict[str, ParameterSharding]] = {}
        for module, tables in _as_dict(doc["plan"], "plan").items():
            where = f"module {module!r}"
            plan[module] = {
                name: _sharding_from_dict(_as_dict(d, f"table {name!r} ({where})"), name, module)
                for name, d in _as_dict(tables, where).items()
            }
        return cls(plan)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON to ``path`` atomically (a reader never sees a half-written plan)."""
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardingPlan:
        """Read a plan written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


# ---------------------------------------------------------------------------------------------
# JSON helpers


def _sharding_to_dict(ps: ParameterSharding) -> dict[str, Any]:
    opt = None
    if ps.optimizer is not None:
        opt = {f.name: getattr(ps.optimizer, f.name) for f in dataclasses.fields(ps.optimizer)}
        opt["betas"] = list(ps.optimizer.betas)
        opt["backend"] = ps.optimizer.backend.value
    return {
        "sharding_type": ps.sharding_type.value,
        "ranks": list(ps.ranks),
        "shards": [dataclasses.asdict(s) for s in ps.shards],
        "backend": ps.backend.value,
        "optimizer": opt,
        "placement": {
            "location": ps.placement.location.value,
            "cache_load_factor": ps.placement.cache_load_factor,
        },
    }


def _sharding_from_dict(d: dict[str, Any], table: str, module: str) -> ParameterSharding:
    where = f"table {table!r} (module {module!r})"
    if "compute_kernel" in d and "backend" not in d:  # the backend's name in older plans
        d = {("backend" if k == "compute_kernel" else k): v for k, v in d.items()}
    keys = {"sharding_type", "ranks", "shards", "backend", "optimizer"}
    # "placement" came later: plans written before it hold every table in device memory.
    _check_keys(d, keys | {"placement"}, where, required=keys)
    try:
        shards = tuple(_shard_from_json(s, where) for s in d["shards"])
        opt = d["optimizer"]
        optimizer = None
        if opt is not None:
            fields = {f.name for f in dataclasses.fields(FusedOptimizerConfig)}
            _check_keys(_as_dict(opt, f"{where} optimizer"), fields, f"{where} optimizer")
            if isinstance(opt.get("betas"), list):
                opt = {**opt, "betas": tuple(opt["betas"])}
            optimizer = FusedOptimizerConfig(**opt)
        ps = ParameterSharding(
            sharding_type=ShardingType(d["sharding_type"]),
            ranks=tuple(d["ranks"]),
            shards=shards,
            backend=Backend(d["backend"]),
            optimizer=optimizer,
            placement=_placement_from_json(d.get("placement"), where),
        )
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where}: malformed sharding in plan JSON: {e}") from e
    for v in (*ps.ranks, *(x for s in shards for x in dataclasses.astuple(s))):
        if type(v) is not int:
            raise PlanError(f"{where}: ranks and shard fields must be integers, got {v!r}")
    return ps


def _placement_from_json(value: object, where: str) -> Placement:
    if value is None:
        return DEVICE
    fields = {"location", "cache_load_factor"}
    d = _as_dict(value, f"{where} placement")
    _check_keys(d, fields, f"{where} placement", required={"location"})
    try:
        return Placement(**d)
    except ValueError as e:
        raise PlanError(f"{where}: {e}") from e


_SHARD_FIELDS = ("rank", "row_offset", "num_rows", "col_offset", "num_cols")


def _shard_from_json(value: object, where: str) -> ShardSpec:
    """A shard as written now (named fields) or by older versions (a 5-item list, same order)."""
    if isinstance(value, list):
        if len(value) != len(_SHARD_FIELDS):
            raise PlanError(
                f"{where}: malformed sharding in plan JSON: a shard list must have "
                f"{len(_SHARD_FIELDS)} items {list(_SHARD_FIELDS)}, got {value!r}"
            )
        value = dict(zip(_SHARD_FIELDS, value, strict=True))
    fields = set(_SHARD_FIELDS)
    _check_keys(_as_dict(value, f"{where} shard"), fields, f"{where} shard", required=fields)
    return ShardSpec(**value)  # type: ignore[arg-type]


def _as_dict(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_keys(
    d: Mapping[str, Any], allowed: set[str], where: str, required: set[str] | None = None
) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise PlanError(f"{where}: unknown keys {unknown} in plan JSON; valid: {sorted(allowed)}")
    missing = sorted((required or set()) - set(d))
    if missing:
        raise PlanError(f"{where}: missing keys {missing} in plan JSON")


def table_names(tables: Sequence[TableLike], module: str) -> list[str]:
    """The tables' names, in order.

    Raises:
        PlanError: two tables of ``module`` share a name.
    """
    names = [t.name for t in tables]
    dupes = sorted(n for n, c in Counter(names).items() if c > 1)
    if dupes:
        raise PlanError(f"module {module!r}: duplicate table names {dupes}; names must be unique")
    return names


def check_world(world_size: int, ranks_per_host: int | None) -> int:
    """Ranks per host (``world_size`` when ``None``), after checking both are positive.

    Raises:
        PlanError: either is below 1.
    """
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    rph = world_size if ranks_per_host is None else ranks_per_host
    if rph < 1:
        raise PlanError(f"ranks_per_host must be >= 1, got {rph}")
    return rph
