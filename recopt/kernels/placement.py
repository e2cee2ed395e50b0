"""Where a table's weights and optimizer state live on a GPU: HBM, UVM, or UVM with an HBM cache.

A per-table (per-shard) choice of the sharding plan, not part of the table's math: the same
table trains to the same values wherever it lives. Only fbgemm's CUDA kernel reads UVM
(``EmbeddingLocation.MANAGED`` / ``MANAGED_CACHING``); on CPU every table is ``device``.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# fbgemm's default, and TorchRec's: a fifth of the table's rows cached in HBM.
DEFAULT_CACHE_LOAD_FACTOR = 0.2


class Location(enum.StrEnum):
    """Where a table's rows are stored.

    ``device``: in the device's memory (HBM on CUDA, host memory on CPU). ``uvm``: in host
    memory the GPU reads over the host link (unified virtual memory). ``uvm_caching``: in host
    memory, with ``cache_load_factor`` of the rows cached in HBM (fbgemm's LRU cache).
    """

    DEVICE = "device"
    UVM = "uvm"
    UVM_CACHING = "uvm_caching"


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where one table (or shard) lives.

    Args:
        location: ``device``, ``uvm`` or ``uvm_caching`` (a string is accepted).
        cache_load_factor: share of the rows the HBM cache holds, in (0, 1]; only for
            ``uvm_caching`` (``None`` there: `DEFAULT_CACHE_LOAD_FACTOR`).

    Raises:
        ValueError: an unknown location, or a cache load factor out of range or given for a
            location without a cache.
    """

    location: Location = Location.DEVICE
    cache_load_factor: float | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "location", Location(self.location))
        except ValueError:
            raise ValueError(
                f"placement location {self.location!r} is unknown; valid: "
                f"{[loc.value for loc in Location]}"
            ) from None
        factor = self.cache_load_factor
        if self.location is not Location.UVM_CACHING:
            if factor is not None:
                raise ValueError(
                    f"placement cache_load_factor={factor!r} is only for location "
                    f"'uvm_caching', not {self.location.value!r}; remove it or use 'uvm_caching'"
                )
            return
        if factor is None:
            object.__setattr__(self, "cache_load_factor", DEFAULT_CACHE_LOAD_FACTOR)
            return
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ValueError(f"placement cache_load_factor must be a number, got {factor!r}")
        if not (math.isfinite(factor) and 0.0 < factor <= 1.0):
            raise ValueError(
                f"placement cache_load_factor must be in (0, 1] (the share of rows cached in "
                f"HBM), got {factor!r}; e.g. 0.2"
            )
        object.__setattr__(self, "cache_load_factor", float(factor))

    @property
    def on_device(self) -> bool:
        """The whole table is in device memory (the only placement on CPU)."""
        return self.location is Location.DEVICE

    @property
    def cache_share(self) -> float:
        """Share of the rows held in HBM: 1 on device, the load factor when cached, else 0."""
        if self.location is Location.DEVICE:
            return 1.0
        return self.cache_load_factor or 0.0

    def describe(self) -> str:
        """``device``, ``uvm`` or ``uvm_caching(0.2)``."""
        if self.location is Location.UVM_CACHING:
            return f"uvm_caching({self.cache_load_factor:g})"
        return self.location.value


DEVICE = Placement()


class PlacedTable(Protocol):
    """What the placement checks need from a kernel's table (``TableSpec`` satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def placement(self) -> Placement: ...


def placement_problems(tables: Sequence[PlacedTable], device_type: str) -> list[str]:
    """Reasons these tables cannot be placed as asked on ``device_type``, each naming the fix.

    UVM exists only on CUDA: on any other device every table must be ``device``.
    """
    if device_type == "cuda":
        return []
    return [
        f"table {t.name!r}: placement {t.placement.describe()!r} needs a CUDA device (UVM is "
        f"CUDA memory), but the kernel runs on {device_type!r}; use placement 'device' there"
        for t in tables
        if not t.placement.on_device
    ]


def placed_off_device(tables: Sequence[PlacedTable]) -> list[str]:
    """Names of the tables not wholly in device memory (they need fbgemm's CUDA kernel)."""
    return [t.name for t in tables if not t.placement.on_device]


def combined_cache_load_factor(rows: Sequence[int], placements: Sequence[Placement]) -> float:
    """One cache load factor for a kernel whose cached tables asked for different ones.

    fbgemm keeps one cache per kernel, sized ``cache_load_factor * rows of its cached tables``;
    the row-weighted mean gives it as many slots as the tables asked for together.
    """
    cached = [
        (n, p.cache_load_factor or DEFAULT_CACHE_LOAD_FACTOR)
        for n, p in zip(rows, placements, strict=True)
        if p.location is Location.UVM_CACHING
    ]
    total = sum(n for n, _ in cached)
    if not total:
        return DEFAULT_CACHE_LOAD_FACTOR
    return sum(n * f for n, f in cached) / total


def fbgemm_uvm_arguments(
    tbe_class: Callable[..., Any], tables: Sequence[PlacedTable]
) -> dict[str, bool]:
    """Extra arguments for fbgemm's TBE so that its UVM is host memory mapped into the GPU.

    By default fbgemm allocates UVM with ``cudaMallocManaged``; asking for more managed memory
    than the card has free can hang the GPU, and the planner places tables larger than HBM
    in UVM on purpose. ``uvm_host_mapped=True`` (fbgemm >= 1.0: ``malloc`` +
    ``cudaHostRegister``) keeps the rows in pinned host memory the GPU reads directly, never
    migrated into HBM. Returned only when some table is off the device and ``tbe_class``
    takes the argument (empty otherwise, so an older fbgemm is called as before).
    """
    if all(t.placement.on_device for t in tables):
        return {}
    try:
        parameters = inspect.signature(tbe_class).parameters
    except (TypeError, ValueError):
        return {}
    return {"uvm_host_mapped": True} if "uvm_host_mapped" in parameters else {}
