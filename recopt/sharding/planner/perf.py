"""Performance estimator: seconds one shard adds to its rank's training step.

A bandwidth model, not a simulator: each term is bytes moved over the bandwidth of the link it
crosses (all-to-all of ids and pooled outputs, rows gathered and updated in memory, all-reduce
for data-parallel; rows of a table in UVM cross the host link, a cached one's misses too).
docs/planner.md states the formulas and what they leave out.
"""

from __future__ import annotations

from dataclasses import dataclass

from recopt.kernels.placement import DEVICE, Location, Placement
from recopt.kernels.registry import optimizer_spec
from recopt.sharding.plan import ShardingType
from recopt.sharding.planner.constraints import TableWorkload
from recopt.sharding.planner.storage import (
    FLOAT_BYTES,
    ID_BYTES,
    hbm_state_bytes,
    ids_to_shard,
    state_bytes,
)
from recopt.sharding.planner.topology import Topology


@dataclass(frozen=True, slots=True)
class Cost:
    """Estimated seconds per step, split by phase."""

    fwd_compute: float
    fwd_comm: float
    bwd_compute: float
    bwd_comm: float

    @property
    def total(self) -> float:
        """Sum of the four phases."""
        return self.fwd_compute + self.fwd_comm + self.bwd_compute + self.bwd_comm


def all_to_all_seconds(num_bytes: float, topology: Topology) -> float:
    """Time for one rank to exchange ``num_bytes`` spread evenly over all ranks.

    The share addressed to itself is free; the rest crosses the intra-host link for peers on the
    same host and the inter-host link for the others.
    """
    w, h = topology.world_size, topology.local_world_size
    return num_bytes * (
        (h - 1) / w / topology.intra_host_bandwidth + (w - h) / w / topology.inter_host_bandwidth
    )


def _row_reduce_seconds(num_bytes: float, kind: ShardingType, topology: Topology) -> float:
    """Time for one row shard to reduce its partial sums of ``num_bytes`` to their owners.

    Row-wise: every partial sum goes to the rank that owns the bag (an all-to-all of the full
    width). Table-row-wise: reduced inside the host first, then each of the host's ranks sends
    its 1/h part of the other hosts' bags across hosts.
    """
    if kind is ShardingType.ROW_WISE:
        return all_to_all_seconds(num_bytes, topology)
    w, h = topology.world_size, topology.local_world_size
    intra = num_bytes * (h - 1) / h / topology.intra_host_bandwidth
    inter = num_bytes * (w - h) / w / h / topology.inter_host_bandwidth
    return intra + inter


def shard_cost(
    kind: ShardingType,
    num_rows: int,
    num_cols: int,
    table_rows: int,
    workload: TableWorkload,
    topology: Topology,
    column_shards: int = 1,
    placement: Placement = DEVICE,
) -> Cost:
    """Seconds one shard of a (non-data-parallel) table adds to its rank per step.

    Args:
        kind: the sharding type.
        num_rows: rows of the shard.
        num_cols: columns of the shard.
        table_rows: rows of the whole table.
        workload: batch size, features, ids per bag and optimizer.
        topology: bandwidths and ranks.
        column_shards: how many column shards the table has (column-wise types).
        placement: where the shard's rows live (UVM rows cross the host link).

    Returns:
        The per-phase estimate.
    """
    w = topology.world_size
    ids = ids_to_shard(kind, num_rows, table_rows, workload, w)
    bags = w * workload.batch_size * workload.num_features
    pooled = FLOAT_BYTES * bags * num_cols
    fwd_compute, bwd_compute = _lookup_and_update_seconds(
        ids, bags, num_rows, num_cols, workload, topology, placement
    )
    inputs = all_to_all_seconds(ID_BYTES * (ids + bags), topology)
    if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        outputs = _row_reduce_seconds(pooled, kind, topology)
    else:
        outputs = all_to_all_seconds(pooled, topology)
    row_stats = 0.0
    if column_shards > 1 and optimizer_spec(workload.optimizer.name).row_wise:
        # A row-wise optimizer on column shards: each shard sends its partial sum of squares of
        # every touched row to the table's other column shards before the update.
        row_stats = all_to_all_seconds(FLOAT_BYTES * ids * (column_shards - 1), topology)
        bwd_compute += ids * topology.row_stat_seconds_per_id
    return Cost(fwd_compute, inputs + outputs, bwd_compute, outputs + row_stats)


def row_seconds_per_byte(
    placement: Placement, workload: TableWorkload, topology: Topology
) -> float:
    """Seconds per byte of a table's rows: HBM for ``device``, the host link for ``uvm``, and
    for ``uvm_caching`` the mix ``h / M + (1 - h) / U`` with ``h`` the cache hit rate (the
    constraint's, else the cache load factor: ids spread evenly over rows)."""
    hbm, uvm = 1.0 / topology.memory_bandwidth, 1.0 / topology.uvm_bandwidth
    if placement.on_device:
        return hbm
    if placement.location is Location.UVM:
        return uvm
    hit = workload.cache_hit_rate
    hit = placement.cache_share if hit is None else hit
    return hit * hbm + (1.0 - hit) * uvm


def _memory_seconds(
    ids: float,
    bags: float,
    rows: int,
    cols: int,
    workload: TableWorkload,
    topology: Topology,
    placement: Placement,
) -> tuple[float, float]:
    """Bytes-moved time of the forward (gather + pool) and backward (grad rows + fused update),
    each byte at the speed of the memory it is in."""
    hbm = 1.0 / topology.memory_bandwidth
    table = row_seconds_per_byte(placement, workload, topology)
    pooled = FLOAT_BYTES * bags * cols
    row_bytes = workload.weight_bytes * cols
    # A state row's bytes, each at the speed of the memory it is in (per-row states of a UVM
    # table in HBM, the [rows, dim] ones in UVM: `hbm_state_bytes`).
    hbm_state_row = hbm_state_bytes(rows, cols, workload, placement) / rows
    host_state_row = state_bytes(rows, cols, workload) / rows - hbm_state_row
    state_seconds = hbm_state_row * hbm + host_state_row / topology.uvm_bandwidth
    # Forward: gather one row per id, write the pooled output.
    fwd = ids * row_bytes * table + pooled * hbm
    # Backward: read the output gradient, write a gradient row per id, then the fused update
    # reads and writes each touched row and its state.
    bwd = (pooled + ids * FLOAT_BYTES * cols) * hbm  # gradient rows: float32 whatever the weights
    bwd += ids * 2 * (row_bytes * table + state_seconds)
    return fwd, bwd


def _lookup_and_update_seconds(
    ids: float,
    bags: float,
    rows: int,
    cols: int,
    workload: TableWorkload,
    topology: Topology,
    placement: Placement = DEVICE,
) -> tuple[float, float]:
    """Time of the forward and backward compute: bytes moved plus the per-id overhead."""
    fwd, bwd = _memory_seconds(ids, bags, rows, cols, workload, topology, placement)
    optimizer = workload.optimizer
    measured = topology.kernel_seconds(optimizer.name, optimizer.backend.value)
    if measured is not None:
        # The kernel that will run was timed on this machine (`recopt-plan --calibrate`) with
        # its table in device memory: that time per id sets the total in device memory, and a
        # table elsewhere is slower by the ratio of the bytes-moved estimates.
        dev_fwd, dev_bwd = (
            (fwd, bwd)
            if placement.on_device
            else _memory_seconds(ids, bags, rows, cols, workload, topology, DEVICE)
        )
        if dev_fwd + dev_bwd > 0.0:
            scale = ids * measured / (dev_fwd + dev_bwd)
            return fwd * scale, bwd * scale
    per_id = ids * topology.seconds_per_id  # what bytes do not capture (measured, see Topology)
    return fwd + per_id, bwd + per_id


def replica_cost(
    rows: int,
    dim: int,
    workload: TableWorkload,
    topology: Topology,
    placement: Placement = DEVICE,
) -> Cost:
    """Seconds a data-parallel replica adds to every rank per step.

    As recopt's sharded module runs it: every rank receives every rank's ids (an all-gather),
    pools the global batch on its replica, and in backward receives every rank's output
    gradient (an all-gather), so it applies the same sparse fused update as the others. No
    dense all-reduce: a replica costs each rank what a table-wise shard costs its one rank,
    less the forward output exchange.
    """
    w = topology.world_size
    bags = w * workload.batch_size * workload.num_features
    ids = bags * workload.pooling_factor
    fwd_compute, bwd_compute = _lookup_and_update_seconds(
        ids, bags, rows, dim, workload, topology, placement
    )
    inputs = all_to_all_seconds(ID_BYTES * (ids + bags), topology)
    grads = all_to_all_seconds(FLOAT_BYTES * bags * dim, topology)
    return Cost(fwd_compute, inputs, bwd_compute, grads)
