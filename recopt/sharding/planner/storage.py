"""Storage estimator: bytes one shard of a table occupies on its rank during training.

Weights and the state of the fused optimizer actually chosen (`optimizer_state_floats`), each
at its dtype's bytes (``weight_dtype``, ``state_dtype``: 4 for fp32, 2 for fp16/bf16), and the
step's buffers: ids and lengths received, pooled outputs and their gradients, a gradient row per
id. Every rank also holds its own pooled outputs for every table. Formulas: docs/planner.md.
"""

from __future__ import annotations

from recopt.kernels.config import optimizer_state_floats
from recopt.sharding.plan import ShardingType
from recopt.sharding.planner.constraints import TableWorkload

FLOAT_BYTES = 4  # pooled outputs and gradients: float32 (weights and state: their dtype)
ID_BYTES = 8  # ids and lengths: int64 (the KeyedJaggedTensor layout)


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
) -> int:
    """Bytes one shard of a (non-data-parallel) table holds on its rank.

    Args:
        kind: the sharding type.
        num_rows: rows of the shard.
        num_cols: columns of the shard.
        table_rows: rows of the whole table.
        workload: batch size, features, ids per bag and optimizer.
        world_size: number of ranks (the shard serves the global batch).

    Returns:
        Weights + optimizer state + the step's buffers, in bytes.
    """
    ids = ids_to_shard(kind, num_rows, table_rows, workload, world_size)
    bags = world_size * workload.batch_size * workload.num_features
    state = optimizer_state_floats(workload.optimizer.name, num_rows, num_cols)
    weights_and_state = workload.weight_bytes * num_rows * num_cols + workload.state_bytes * state
    inputs = ID_BYTES * (ids + bags)
    outputs = 2 * FLOAT_BYTES * bags * num_cols  # pooled (partial sums for row types) and grad
    grad_rows = FLOAT_BYTES * ids * num_cols
    return int(weights_and_state + inputs + outputs + grad_rows)


def replica_storage_bytes(rows: int, dim: int, workload: TableWorkload, world_size: int) -> int:
    """Bytes a data-parallel replica holds on every rank.

    recopt's sharded module pools the global batch on every replica (every rank's ids arrive by
    all-gather) and updates it sparsely, so a replica holds what a table-wise shard of the whole
    table holds; there is no dense gradient.
    """
    return shard_storage_bytes(ShardingType.TABLE_WISE, rows, dim, rows, workload, world_size)


def rank_output_bytes(dim: int, workload: TableWorkload) -> int:
    """Bytes every rank holds for one table's pooled outputs of its own batch, and their grads."""
    return 2 * FLOAT_BYTES * workload.batch_size * workload.num_features * dim
