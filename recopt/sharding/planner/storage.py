"""Storage estimator: bytes one shard of a table occupies on its rank during training.

Weights and the state of the fused optimizer actually chosen (`optimizer_state_floats`), each
at its dtype's bytes (``weight_dtype``, ``state_dtype``: 4 for fp32, 2 for fp16/bf16), and the
step's buffers: ids and lengths received, pooled outputs and their gradients, a gradient row per
id. Every rank also holds its own pooled outputs for every table. Where weights and state sit
depends on the placement: device memory, host memory (UVM), or host memory with an HBM cache.
Formulas: docs/planner.md.
"""

from __future__ import annotations

import math

from recopt.kernels.config import optimizer_state_floats
from recopt.kernels.placement import DEVICE, Location, Placement
from recopt.kernels.registry import StateShape, optimizer_spec
from recopt.sharding.plan import ShardingType
from recopt.sharding.planner.constraints import TableWorkload

FLOAT_BYTES = 4  # pooled outputs and gradient rows: float32 (weights and state: their dtype)
ID_BYTES = 8  # ids and lengths: int64 (the KeyedJaggedTensor layout)
# fbgemm's cache keeps, per slot, the row's index and its LRU time step (two int64).
CACHE_SLOT_BYTES = 16
PER_ROW = StateShape.PER_ROW


def weight_bytes(num_rows: int, num_cols: int, workload: TableWorkload) -> int:
    """Bytes of a shard's weights."""
    return workload.weight_bytes * num_rows * num_cols


def state_bytes(num_rows: int, num_cols: int, workload: TableWorkload) -> int:
    """Bytes of a shard's fused-optimizer state."""
    floats = optimizer_state_floats(workload.optimizer.name, num_rows, num_cols)
    return workload.state_bytes * floats


def hbm_state_bytes(
    num_rows: int, num_cols: int, workload: TableWorkload, placement: Placement
) -> int:
    """Bytes of a shard's optimizer state in HBM: all of it in device memory; off the device,
    only its per-row states (row-wise Adagrad's ``momentum1``, row-wise Adam's and LAMB's
    ``exp_avg_sq``), which fbgemm keeps on the device for a UVM table, while the ``[rows, dim]``
    ones (``exp_avg``, Adagrad's sum) stay in UVM with the weights (fbgemm's
    ``construct_split_state``: a state goes to the device when its table does or it is row-wise).
    """
    if placement.on_device:
        return state_bytes(num_rows, num_cols, workload)
    states = optimizer_spec(workload.optimizer.name).states
    per_row = sum(shape.floats(num_rows, num_cols) for _, shape in states if shape is PER_ROW)
    return workload.state_bytes * per_row


def cache_rows(num_rows: int, placement: Placement) -> int:
    """Rows the HBM cache holds for a shard (0 unless ``uvm_caching``)."""
    if placement.location is not Location.UVM_CACHING:
        return 0
    return math.ceil(num_rows * (placement.cache_load_factor or 0.0))


def resident_bytes(
    num_rows: int, num_cols: int, workload: TableWorkload, placement: Placement = DEVICE
) -> tuple[int, int]:
    """(HBM, host) bytes of a shard's weights, state and cache under ``placement``.

    ``device``: weights and state in device memory. ``uvm``: weights and the ``[rows, dim]``
    states in host memory, per-row states in HBM (`hbm_state_bytes`). ``uvm_caching``: the
    same, plus a cache of ``cache_load_factor`` of the rows in HBM (a row of weights and
    `CACHE_SLOT_BYTES` per slot).
    """
    weights = weight_bytes(num_rows, num_cols, workload)
    state = state_bytes(num_rows, num_cols, workload)
    if placement.on_device:
        return weights + state, 0
    hbm_state = hbm_state_bytes(num_rows, num_cols, workload, placement)
    slots = cache_rows(num_rows, placement)
    cache = slots * (workload.weight_bytes * num_cols + CACHE_SLOT_BYTES)
    return cache + hbm_state, weights + state - hbm_state


def ids_to_shard(
    kind: ShardingType, num_rows: int, table_rows: int, workload: TableWorkload, world_size: int
) -> float:
    """Ids a non-replicated shard looks up per step: the global batch's ids in its row range.

    Ids are assumed uniform over rows, so a row range of ``num_rows`` receives that share.
    """
    global_ids = world_size * workload.batch_size * workload.num_features * workload.pooling_factor
    if kind.splits_rows:
        return global_ids * num_rows / table_rows
    return global_ids


def shard_storage_bytes(
    kind: ShardingType,
    num_rows: int,
    num_cols: int,
    table_rows: int,
    workload: TableWorkload,
    world_size: int,
    placement: Placement = DEVICE,
) -> int:
    """Bytes one shard of a (non-data-parallel) table holds in its rank's device memory.

    Args:
        kind: the sharding type.
        num_rows: rows of the shard.
        num_cols: columns of the shard.
        table_rows: rows of the whole table.
        workload: batch size, features, ids per bag and optimizer.
        world_size: number of ranks (the shard serves the global batch).
        placement: where weights and state live (`resident_bytes`); host bytes are
            `resident_bytes`'s second value.

    Returns:
        The device-resident part of weights + optimizer state (+ cache), and the step's
        buffers, in bytes.
    """
    ids = ids_to_shard(kind, num_rows, table_rows, workload, world_size)
    bags = world_size * workload.batch_size * workload.num_features
    weights_and_state, _ = resident_bytes(num_rows, num_cols, workload, placement)
    inputs = ID_BYTES * (ids + bags)
    outputs = 2 * FLOAT_BYTES * bags * num_cols  # pooled (partial sums for row types) and grad
    grad_rows = FLOAT_BYTES * ids * num_cols
    return int(weights_and_state + inputs + outputs + grad_rows)


def replica_storage_bytes(
    rows: int,
    dim: int,
    workload: TableWorkload,
    world_size: int,
    placement: Placement = DEVICE,
) -> int:
    """Bytes a data-parallel replica holds in every rank's device memory.

    recopt's sharded module pools the global batch on every replica (every rank's ids arrive by
    all-gather) and updates it sparsely, so a replica holds what a table-wise shard of the whole
    table holds; there is no dense gradient.
    """
    return shard_storage_bytes(
        ShardingType.TABLE_WISE, rows, dim, rows, workload, world_size, placement
    )


def rank_output_bytes(dim: int, workload: TableWorkload) -> int:
    """Bytes every rank holds for one table's pooled outputs of its own batch, and their grads."""
    return 2 * FLOAT_BYTES * workload.batch_size * workload.num_features * dim
