"""``torchrec.distributed.planner.types``: `Topology` and `ParameterConstraints` with TorchRec's
arguments, built as recopt's planner types.

TorchRec's bandwidths are bytes per millisecond, recopt's bytes per second: given ones are
converted. Arguments for what recopt does not model (SSD, pods, custom comms data) are
refused when set, naming them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from recopt.kernels.placement import Location, Placement
from recopt.sharding import ShardingType
from recopt.sharding.planner import ParameterConstraints as _RecoptConstraints
from recopt.sharding.planner import Topology as _RecoptTopology

__all__ = ["ParameterConstraints", "Topology"]

GIB = 1024**3
_PER_MS = 1000.0  # TorchRec bandwidths are bytes/ms
# TorchRec's compute kernel -> where recopt places the table ("dense" has no fused kernel).
_KERNEL_PLACEMENTS = {"fused": "device", "fused_uvm": "uvm", "fused_uvm_caching": "uvm_caching"}


def _refuse(owner: str, values: dict[str, Any], defaults: dict[str, Any]) -> None:
    for name, value in values.items():
        if value != defaults.get(name):
            raise ValueError(
                f"{owner}({name}={value!r}): recopt has no equivalent; leave it at "
                f"{defaults.get(name)!r} (docs/torchrec.md lists the differences)"
            )


def Topology(  # noqa: N802 (TorchRec's class name; this builds recopt's Topology)
    world_size: int,
    compute_device: str,
    hbm_cap: int | None = None,
    ddr_cap: int | None = None,
    local_world_size: int | None = None,
    hbm_mem_bw: float | None = None,
    ddr_mem_bw: float | None = None,
    intra_host_bw: float | None = None,
    inter_host_bw: float | None = None,
    **unsupported: Any,
) -> _RecoptTopology:
    """recopt's `Topology` from TorchRec's arguments (caps in bytes, bandwidths in bytes/ms).

    ``hbm_cap`` defaults to TorchRec's 32 GiB on CUDA; ``ddr_cap`` to recopt's default.

    Raises:
        ValueError: an argument recopt does not model, set to a non-default value.
    """
    _refuse("Topology", unsupported, {"created_by_factory": False})
    values: dict[str, Any] = {
        "world_size": world_size,
        "device": compute_device,
        "ranks_per_host": local_world_size,
    }
    if compute_device == "cuda":
        values["hbm_bytes"] = int(hbm_cap) if hbm_cap is not None else 32 * GIB
    if ddr_cap is not None:
        values["ddr_bytes"] = int(ddr_cap)
    memory_bw = hbm_mem_bw if compute_device == "cuda" else ddr_mem_bw
    for name, value in (
        ("memory_bandwidth", memory_bw),
        ("intra_host_bandwidth", intra_host_bw),
        ("inter_host_bandwidth", inter_host_bw),
    ):
        if value is not None:
            values[name] = float(value) * _PER_MS
    return _RecoptTopology(**values)


def _kernel_placements(kernels: Sequence[str]) -> tuple[Placement, ...]:
    placements = []
    for kernel in kernels:
        name = str(getattr(kernel, "value", kernel))
        if name not in _KERNEL_PLACEMENTS:
            raise ValueError(
                f"ParameterConstraints compute_kernels {name!r}: recopt runs every table with a "
                f"fused optimizer; use one of {sorted(_KERNEL_PLACEMENTS)}"
            )
        placements.append(Placement(location=Location(_KERNEL_PLACEMENTS[name])))
    return tuple(placements)


@dataclass
class ParameterConstraints:
    """TorchRec's per-table planner constraints; `to_recopt` gives recopt's.

    Args:
        sharding_types: allowed sharding types (``ShardingType.X.value`` strings).
        compute_kernels: ``fused``, ``fused_uvm``, ``fused_uvm_caching``: where the table may
            live (recopt's placements).
        min_partition: the narrowest column shard.
        pooling_factors: average ids per bag, one per feature (recopt plans with the mean).
        batch_sizes: per-feature batch sizes (recopt plans with the largest).
        is_weighted: read from the module by recopt; accepted.
        Others (``num_poolings``, ``cache_params``, ``enforce_hbm``, ...): only their default.
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    num_poolings: list[float] | None = None
    batch_sizes: list[int] | None = None
    is_weighted: bool = False
    cache_params: Any = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: Any = None
    feature_names: list[str] | None = None
    output_dtype: Any = None
    device_group: str | None = None
    key_value_params: Any = None
    use_virtual_table: bool = False

    def to_recopt(self) -> _RecoptConstraints:
        """recopt's constraints for the same table.

        Raises:
            ValueError: a field recopt has no equivalent for, set (naming it).
        """
        unsupported = [
            "num_poolings",
            "cache_params",
            "enforce_hbm",
            "stochastic_rounding",
            "bounds_check_mode",
            "output_dtype",
            "device_group",
            "key_value_params",
            "feature_names",
        ]
        values = {name: getattr(self, name) for name in unsupported}
        _refuse("ParameterConstraints", values, {})
        _refuse(
            "ParameterConstraints",
            {"use_virtual_table": self.use_virtual_table},
            {"use_virtual_table": False},
        )
        kwargs: dict[str, Any] = {}
        if self.sharding_types is not None:
            kwargs["sharding_types"] = tuple(
                ShardingType(str(getattr(t, "value", t))) for t in self.sharding_types
            )
        if self.compute_kernels is not None:
            kwargs["placements"] = _kernel_placements(self.compute_kernels)
        if self.min_partition is not None:
            kwargs["min_partition"] = self.min_partition
        if self.pooling_factors:
            kwargs["pooling_factor"] = sum(self.pooling_factors) / len(self.pooling_factors)
        if self.batch_sizes:
            kwargs["batch_size"] = max(self.batch_sizes)
        return _RecoptConstraints(**kwargs)
