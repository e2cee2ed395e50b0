"""One backend per kernel shape on every rank: rank 0 resolves ``Backend.AUTO`` for all.

Replicas (data-parallel tables) must run the same backend to stay bit-identical, so the
sharded collections build their kernels with rank 0's decisions (`recopt.kernels.autotune`
measures; `recopt.comm` carries them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt import comm
from recopt.comm import ProcessGroup
from recopt.kernels.autotune import default_resolver
from recopt.kernels.config import FusedOptimizerConfig, TableSpec
from recopt.kernels.contract import BackendDecision
from recopt.kernels.factory import auto_candidates

# One kernel as create_kernel sees it: its tables, feature-to-table map and optimizer.
KernelRequest = tuple[list[TableSpec], list[int], FusedOptimizerConfig]


def share_backend_decisions(
    kernels: Sequence[KernelRequest], device: torch.device, group: ProcessGroup | None
) -> dict[str, BackendDecision]:
    """Resolve every rank's ``Backend.AUTO`` kernels on rank 0 and give all ranks its answers.

    Ranks holding replicas of a table (data-parallel) must run the same backend to stay
    bit-identical, and each rank's own measurement can differ under load. Every rank sends its
    kernels' shape classes to rank 0 (one all-gather), rank 0 resolves them all (pin, cache, or
    a measurement of the probe, which needs only the shape class), and broadcasts the
    decisions, which every rank adopts. Two collectives, bounded by the group's timeout.

    Args:
        kernels: this rank's kernels, before they are built.
        device: where they will run.
        group: the process group (a no-op on one rank).

    Returns:
        The decisions adopted, by shape-class key.
    """
    if dist.get_world_size(group) == 1:
        return {}
    requests = []
    for tables, feature_table_map, optimizer in kernels:
        request = auto_candidates(tables, optimizer, device, feature_table_map)
        if request is not None:
            requests.append((request[0], optimizer, request[1]))
    gathered = comm.all_gather_object(requests, group)
    resolver = default_resolver()
    shared: dict[str, Any] | None = None
    if dist.get_rank(group) == 0:
        decisions: dict[str, BackendDecision] = {}
        for shape, optimizer, candidates in (r for rank in gathered for r in rank):
            decision = resolver.resolve(shape, optimizer, candidates)
            decisions.setdefault(shape.key(), decision)
        shared = {k: d.to_json() for k, d in decisions.items()}
    shared = comm.broadcast_object(shared, group)
    assert shared is not None
    adopted = {
        k: BackendDecision.from_json({**v, "reason": f"shared by rank 0 ({v['reason']})"})
        for k, v in shared.items()
    }
    resolver.adopt(adopted)
    return adopted
