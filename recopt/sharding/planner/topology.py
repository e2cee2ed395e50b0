"""The machine the planner plans for: ranks, hosts, memory per rank and bandwidths.

Defaults describe a small CPU box (the figures `recopt-plan --calibrate` measured on the
development machine, rounded down); `--calibrate` writes a file for yours and `--topology FILE`
reads it back. Files are TOML (or JSON) with the field names of `Topology`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass
from typing import Any

import torch

from recopt.kernels.placement import DEFAULT_CACHE_LOAD_FACTOR

GIB = 1024**3
GB = 1e9

# Measured with `recopt-plan --calibrate --ranks-per-host 2` on the 2-core development VM
# (shared with other jobs, so noisy): one tensor copy 8.6 GB/s, gloo all-to-all between two local
# ranks 0.42 GB/s; rounded down. Inter-host bandwidth cannot be measured on one machine: a
# 10 Gb/s network carries at most 1.25 GB/s, and gloo there is no faster than between local
# ranks, so the default is the local figure.
DEFAULT_MEMORY_BANDWIDTH = 8.0 * GB
DEFAULT_INTRA_HOST_BANDWIDTH = 0.4 * GB
DEFAULT_INTER_HOST_BANDWIDTH = 0.4 * GB
NETWORK_10GBE_BANDWIDTH = 1.25 * GB
# Per-id time beyond the bytes moved (index arithmetic, sorting, kernel and Python overheads),
# per phase (forward, backward): the sharded module on 2 ranks on the development VM spent
# 1.5-3 us per id looked up in forward + backward, where the bandwidth terms alone gave 0.2 us.
DEFAULT_SECONDS_PER_ID = 1e-6
# Extra per id and column shard for row-wise optimizers on column shards (the full-row
# statistic exchange): column-wise plans measured 30-60 ms slower over ~36k shard-ids.
DEFAULT_ROW_STAT_SECONDS_PER_ID = 1e-6
# GPU tables (docs/planner.md, "Placement"). HBM: an A100's 1.5-2 TB/s and an H100's 3 TB/s
# peak, of which row gathers reach about half; rounded down. UVM: rows read by the GPU over the
# host link, a PCIe 4.0 x16 link carries about 25 GB/s and row-sized reads less. Neither is
# measured on a GPU host yet; `recopt-plan --calibrate` on CUDA measures both.
DEFAULT_HBM_BANDWIDTH = 800.0 * GB
DEFAULT_UVM_BANDWIDTH = 16.0 * GB
DEVICES = ("cpu", "cuda")


class TopologyError(ValueError):
    """A topology field is out of range, unknown, or a topology file cannot be read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Ranks, hosts, memory and bandwidth, as the planner's estimators see them.

    Args:
        world_size: number of ranks.
        ranks_per_host: ranks sharing a host (``None``: all on one host); rank r is on host
            ``r // ranks_per_host``.
        device: ``cpu`` (tables in DDR) or ``cuda`` (tables in HBM).
        hbm_bytes: device memory per rank (used when ``device`` is ``cuda``).
        ddr_bytes: host memory per rank: where tables live on ``cpu``; on ``cuda``, what UVM
            placements may fill (less the same reserve).
        reserve_fraction: share of each rank's memory kept back for the dense model,
            activations and allocator slack; the planner fills only the rest.
        memory_bandwidth: bytes/s one rank reads or writes embedding rows at.
        intra_host_bandwidth: bytes/s one rank sends to ranks on its own host.
        inter_host_bandwidth: bytes/s one rank sends to ranks on other hosts.
        seconds_per_id: time per id looked up, per phase, beyond the bytes it moves.
        row_stat_seconds_per_id: extra time per id of a column shard of a row-wise optimizer
            (the full-row statistic exchange).
        kernel_backends: optimizer name -> the backend ``Backend.AUTO`` chose on this machine
            (``recopt-plan --calibrate``); empty when not measured.
        kernel_seconds_per_id: ``"<optimizer>/<backend>"`` -> measured seconds per id of a
            fused kernel's forward + backward + update; replaces ``seconds_per_id`` and the
            bytes-moved compute estimate for that kernel (docs/planner.md).
        uvm_bandwidth: bytes/s the GPU reads or writes rows of a table in UVM (host memory
            over the host link); ``cuda`` only.
        cache_load_factor: share of a table's rows the HBM cache holds when the planner
            chooses ``uvm_caching`` itself (constraints may name others).
    """

    world_size: int
    ranks_per_host: int | None = None
    device: str = "cpu"
    hbm_bytes: int = 0
    ddr_bytes: int = 4 * GIB
    reserve_fraction: float = 0.1
    memory_bandwidth: float = DEFAULT_MEMORY_BANDWIDTH
    intra_host_bandwidth: float = DEFAULT_INTRA_HOST_BANDWIDTH
    inter_host_bandwidth: float = DEFAULT_INTER_HOST_BANDWIDTH
    seconds_per_id: float = DEFAULT_SECONDS_PER_ID
    row_stat_seconds_per_id: float = DEFAULT_ROW_STAT_SECONDS_PER_ID
    kernel_backends: dict[str, str] = dataclasses.field(default_factory=dict)
    kernel_seconds_per_id: dict[str, float] = dataclasses.field(default_factory=dict)
    uvm_bandwidth: float = DEFAULT_UVM_BANDWIDTH
    cache_load_factor: float = DEFAULT_CACHE_LOAD_FACTOR

    def __post_init__(self) -> None:
        for name in ("world_size", "hbm_bytes", "ddr_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TopologyError(f"topology {name} must be an int >= 0, got {value!r}")
        if self.world_size < 1:
            raise TopologyError(f"topology world_size must be >= 1, got {self.world_size}")
        rph = self.ranks_per_host
        if rph is not None and (not isinstance(rph, int) or rph < 1):
            raise TopologyError(f"topology ranks_per_host must be an int >= 1, got {rph!r}")
        if self.device not in DEVICES:
            raise TopologyError(f"topology device {self.device!r} is unknown; valid: {DEVICES}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise TopologyError(
                f"topology reserve_fraction must be in [0, 1), got {self.reserve_fraction}"
            )
        if not 0.0 < float(self.cache_load_factor) <= 1.0:
            raise TopologyError(
                f"topology cache_load_factor must be in (0, 1], got {self.cache_load_factor!r}; "
                "e.g. 0.2"
            )
        bandwidths = ("memory_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth")
        for name in (*bandwidths, "uvm_bandwidth"):
            if not float(getattr(self, name)) > 0.0:
                raise TopologyError(
                    f"topology {name} must be > 0 bytes/s, got {getattr(self, name)!r}"
                )
        for name in ("seconds_per_id", "row_stat_seconds_per_id"):
            if not float(getattr(self, name)) >= 0.0:
                raise TopologyError(f"topology {name} must be >= 0 s, got {getattr(self, name)!r}")
        self._validate_kernels()
        if self.memory_bytes == 0:
            field = "hbm_bytes" if self.device == "cuda" else "ddr_bytes"
            raise TopologyError(
                f"topology {field} is 0 for device {self.device!r}; give the memory per rank"
            )

    def _validate_kernels(self) -> None:
        backends = ("fbgemm", "recopt")
        for field in ("kernel_backends", "kernel_seconds_per_id"):
            if not isinstance(getattr(self, field), dict):
                raise TopologyError(
                    f"topology {field} must be a table, got {getattr(self, field)!r}"
                )
        for name, backend in self.kernel_backends.items():
            if backend not in backends:
                raise TopologyError(
                    f"topology kernel_backends[{name!r}] = {backend!r}; valid: {backends}"
                )
        for key, seconds in self.kernel_seconds_per_id.items():
            if key.count("/") != 1 or key.split("/")[1] not in backends:
                raise TopologyError(
                    f"topology kernel_seconds_per_id key {key!r} is not '<optimizer>/<backend>' "
                    f"with a backend in {backends}"
                )
            if not float(seconds) > 0.0:
                raise TopologyError(
                    f"topology kernel_seconds_per_id[{key!r}] must be > 0 s, got {seconds!r}"
                )

    def kernel_seconds(self, optimizer: str, backend: str) -> float | None:
        """Measured seconds per id of ``optimizer``'s kernel on ``backend`` (``auto``: the
        backend recorded as AUTO's choice), or ``None`` when not measured."""
        if backend == "auto":
            backend = self.kernel_backends.get(optimizer, "")
        return self.kernel_seconds_per_id.get(f"{optimizer}/{backend}")

    @property
    def host_usable_bytes(self) -> int:
        """Host memory per rank UVM placements may fill (cuda; 0 on cpu, where every table is
        already in host memory and counted in `usable_bytes`)."""
        if self.device != "cuda":
            return 0
        return int(self.ddr_bytes * (1.0 - self.reserve_fraction))

    @property
    def local_world_size(self) -> int:
        """Ranks per host, resolved (at most ``world_size``)."""
        return min(self.world_size, self.ranks_per_host or self.world_size)

    @property
    def num_hosts(self) -> int:
        """Number of hosts (the last one may be partly filled)."""
        return -(-self.world_size // self.local_world_size)

    @property
    def memory_bytes(self) -> int:
        """Memory per rank that holds embedding tables (HBM on cuda, DDR on cpu)."""
        return self.hbm_bytes if self.device == "cuda" else self.ddr_bytes

    @property
    def usable_bytes(self) -> int:
        """Memory per rank the planner may fill (``memory_bytes`` less the reserve)."""
        return int(self.memory_bytes * (1.0 - self.reserve_fraction))

    def host_ranks(self, host: int) -> range:
        """The ranks of one host."""
        rph = self.local_world_size
        return range(host * rph, min(self.world_size, (host + 1) * rph))

    def replace(self, **changes: Any) -> Topology:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_toml(self) -> str:
        """The fields as a flat TOML document (``ranks_per_host`` omitted when ``None``)."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == {}:
                continue
            if isinstance(value, dict):  # an inline table: {"key" = value, ...}
                items = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{f.name} = {{ {items} }}")
                continue
            lines.append(f"{f.name} = {json.dumps(value)}")
        return "\n".join(lines) + "\n"


def host_memory_bytes(ranks_per_host: int) -> int:
    """Physical memory of this machine divided among ``ranks_per_host`` ranks."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_host


def cuda_memory_bytes(device: torch.device | str | int | None = None) -> int:
    """Device memory this process can fill on a GPU now (default: the current one).

    The free memory (`torch.cuda.mem_get_info`) plus what this process's caching allocator
    holds but no tensor uses (reserved minus allocated), at most the GPU's total memory. Live
    tensors count as used, an unsharded model too: the sharded tables are allocated while it
    is still there (build the model on the ``meta`` device to plan against the whole GPU).
    """
    index = _cuda_index(device)
    free, _ = torch.cuda.mem_get_info(index)
    total = int(torch.cuda.get_device_properties(index).total_memory)
    cached = int(torch.cuda.memory_reserved(index)) - int(torch.cuda.memory_allocated(index))
    return min(total, int(free) + max(0, cached))


def _cuda_index(device: torch.device | str | int | None) -> int:
    """The GPU index ``device`` names; the current GPU when it names none."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def local_topology(
    world_size: int,
    ranks_per_host: int | None = None,
    device: torch.device | str | None = None,
) -> Topology:
    """A topology whose memory per rank is this machine's, for planning inside a job.

    Args:
        world_size: number of ranks.
        ranks_per_host: ranks per host (default: all on one host); host memory is divided
            among them.
        device: ``cpu``, ``cuda`` (the current GPU) or a ``torch.device`` such as ``cuda:1``
            (default: ``cuda`` when available).

    Returns:
        The default bandwidths (HBM's on cuda) with DDR (physical memory over the ranks of a
        host) and, on cuda, HBM (`cuda_memory_bytes` of that GPU: what this process can fill
        now) filled in. Each rank measures its own machine; `shared_topology` makes the
        figures the same on every rank.

    Raises:
        TopologyError: ``device`` is neither a CPU nor a CUDA device.
    """
    if device is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        kind = torch.device(device).type
    if kind not in DEVICES:
        raise TopologyError(f"topology device {kind!r} is unknown; valid: {DEVICES}")
    rph = min(world_size, ranks_per_host or world_size)
    hbm, memory_bandwidth = 0, DEFAULT_MEMORY_BANDWIDTH
    if kind == "cuda":
        hbm = cuda_memory_bytes(device)
        memory_bandwidth = DEFAULT_HBM_BANDWIDTH
    return Topology(
        world_size=world_size,
        ranks_per_host=ranks_per_host,
        device=kind,
        hbm_bytes=hbm,
        ddr_bytes=host_memory_bytes(rph),
        memory_bandwidth=memory_bandwidth,
    )


def topology_fields() -> set[str]:
    """Names a topology file or a ``[planner]`` section may set."""
    return {f.name for f in dataclasses.fields(Topology)}


def topology_from_dict(values: dict[str, Any], where: str, **overrides: Any) -> Topology:
    """Build a topology from parsed TOML/JSON values.

    Args:
        values: field name -> value; unknown names are an error.
        where: what the values came from, for error messages.
        **overrides: fields that win over ``values`` (e.g. ``world_size`` from the command line).

    Raises:
        TopologyError: an unknown field, or a value out of range.
    """
    unknown = sorted(set(values) - topology_fields())
    if unknown:
        raise TopologyError(
            f"{where}: unknown topology keys {unknown}; valid: {sorted(topology_fields())}"
        )
    merged = {**values, **overrides}
    if "world_size" not in merged:
        raise TopologyError(f"{where}: world_size is not set; give it (or --world-size)")
    floats = (
        "memory_bandwidth",
        "intra_host_bandwidth",
        "inter_host_bandwidth",
        "seconds_per_id",
        "row_stat_seconds_per_id",
        "uvm_bandwidth",
        "cache_load_factor",
    )
    for name in floats:
        if isinstance(merged.get(name), int):
            merged[name] = float(merged[name])
    return Topology(**merged)


def load_topology_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a topology file (``.json``, otherwise TOML) into a dict of fields.

    Raises:
        TopologyError: the file is missing or does not parse.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if os.fspath(path).endswith(".json"):
            values = json.loads(raw)
        else:
            values = tomllib.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise TopologyError(f"topology file {os.fspath(path)!r} cannot be read: {e}") from e
    if not isinstance(values, dict):
        raise TopologyError(f"topology file {os.fspath(path)!r} must hold a table of fields")
    return values
