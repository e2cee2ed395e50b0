"""Before the DLRM script allocates its shards: do they fit in this host's memory?

The plan says which rows of which table each rank holds; their weights and fused-optimizer
state, plus the dense model, are what the ranks of a host will allocate. A run that does not
fit used to be SIGKILLed by a memory limit or the kernel's OOM killer with no message (and the
OOM killer may pick another process). This checks it first, the same answer on every rank,
and names both numbers and the fix. On CUDA the planner already fits the plan into each GPU's
measured memory; this check is for the host memory of CPU runs.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from recopt import comm
from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.config import optimizer_state_floats
from recopt.modules import EmbeddingBagConfig
from recopt.sharding.plan import ParameterSharding, ShardingType

GIB = float(1 << 30)
# Dense parameters: weights, gradients and up to two optimizer states (Adam).
DENSE_COPIES = 4


def shard_bytes(
    shardings: Mapping[str, ParameterSharding],
    tables: Sequence[EmbeddingBagConfig],
    optimizer: FusedOptimizerConfig,
    rank: int,
) -> int:
    """Bytes of the weights and fused-optimizer state that ``rank`` holds under the plan."""
    total = 0
    for table in tables:
        sharding = shardings[table.name]
        opt = sharding.optimizer or optimizer
        if sharding.sharding_type is ShardingType.DATA_PARALLEL:
            parts = [(table.num_embeddings, table.embedding_dim)] if rank in sharding.ranks else []
        else:
            parts = [(s.num_rows, s.num_cols) for s in sharding.shards if s.rank == rank]
        for rows, cols in parts:
            weights = rows * cols * table.weight_dtype.bytes
            state = optimizer_state_floats(opt.name, rows, cols) * opt.state_dtype.bytes
            total += weights + state
    return total


def available_host_bytes() -> tuple[int, str]:
    """Memory this process may still use, and where the figure comes from: the least of
    the kernel's MemAvailable and the cgroup's (v2) limit less its usage."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append((int(limit) - used, "the cgroup's memory.max less memory.current"))
    except (OSError, ValueError):
        pass
    return min(found) if found else (1 << 62, "unknown")


def check_host_memory(
    shardings: Mapping[str, ParameterSharding],
    tables: Sequence[EmbeddingBagConfig],
    optimizer: FusedOptimizerConfig,
    dense: nn.Module,
    host_ranks: Sequence[int],
    timeout: datetime.timedelta,
    available: tuple[int, str] | None = None,
) -> None:
    """Raises on every rank if some host's ranks need more memory than the host has.

    Args:
        shardings: the plan of the embedding collection (table -> sharding).
        tables: the collection's tables.
        optimizer: their fused optimizer (a sharding's own one wins).
        dense: the dense part of the model (its parameters are counted `DENSE_COPIES` times
            on every rank).
        host_ranks: the ranks on this rank's host (they share its memory).
        timeout: limit for the one all-reduce that makes every rank agree.
        available: (bytes, source) to compare with; None reads this host's.

    Raises:
        MemoryError: naming the bytes needed, the bytes available and the fix.
    """
    dense_bytes = DENSE_COPIES * sum(p.numel() * p.element_size() for p in dense.parameters())
    needed = sum(shard_bytes(shardings, tables, optimizer, r) for r in host_ranks)
    needed += dense_bytes * len(host_ranks)
    free, source = available if available is not None else available_host_bytes()
    fits = needed <= free
    if torch.distributed.is_initialized():  # the same answer on every rank
        fits = comm.all_ranks_finite(torch.tensor(fits), None, timeout)
    if fits:
        return
    raise MemoryError(
        f"the embedding shards do not fit in memory: the plan gives ranks {list(host_ranks)} "
        f"of this host {needed / GIB:.2f} GiB of table weights and optimizer state plus the "
        f"dense model, and {free / GIB:.2f} GiB is available ({source}) on this host (or on "
        "another rank's). Run on more ranks or hosts (torchrun --nnodes / --nproc-per-node), "
        "shrink the tables (embedding.tables.N.num_embeddings), store them in half precision "
        '(embedding.weight_dtype = "bf16", embedding.optimizer.state_dtype = "bf16"), or free '
        "memory"
    )


def host_ranks(rank: int, local_world_size: int | None, world_size: int) -> list[int]:
    """The ranks on this rank's host: torchrun numbers a host's ranks consecutively."""
    local = local_world_size or world_size
    first = rank - rank % local
    return list(range(first, min(first + local, world_size)))
