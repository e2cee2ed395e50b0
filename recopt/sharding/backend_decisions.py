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
from recopt.kernels.contract import BackendDecision
from recopt.kernels.factory import KernelRequest, auto_requests, resolve_requests


class BackendDecisionError(ValueError):
    """Another rank could not take part in the backend decision (its kernels are refused, or
    rank 0's resolution failed), so every rank stops instead of waiting for it."""


def share_backend_decisions(
    kernels: Sequence[KernelRequest], device: torch.device, group: ProcessGroup | None
) -> dict[str, BackendDecision]:
    """Resolve every rank's ``Backend.AUTO`` kernels on rank 0 and give all ranks its answers.

    Ranks holding replicas of a table (data-parallel) must run the same backend to stay
    bit-identical, and each rank's own measurement can differ under load. Every rank sends its
    kernels' shape classes to rank 0 (one all-gather), rank 0 resolves them all (pin, cache, or
    a measurement of the probe, which needs only the shape class), and broadcasts the
    decisions, which every rank adopts. Two collectives, bounded by the group's timeout. A
    failure travels with them: a rank whose kernels are refused sends its refusal in the
    all-gather, rank 0 broadcasts an error of its resolution, and every rank then raises.

    Args:
        kernels: this rank's kernels, before they are built.
        device: where they will run.
        group: the process group (a no-op on one rank).

    Returns:
        The decisions adopted, by shape-class key.

    Raises:
        ValueError: this rank's kernels are refused (the refusal itself).
        BackendDecisionError: another rank's kernels are refused, or rank 0's resolution
            failed (rank 0 raises its own error); the message names the rank and the error.
        Exception: on rank 0, whatever stopped its resolution.
    """
    if dist.get_world_size(group) == 1:
        return {}
    requests, refusal = auto_requests(kernels, device)
    sent = (requests, None if refusal is None else str(refusal))
    gathered = comm.all_gather_object(sent, group)
    if refusal is not None:
        raise refusal
    refused = [f"rank {r}: {message}" for r, (_, message) in enumerate(gathered) if message]
    if refused:
        raise BackendDecisionError(
            f"other ranks' kernels were refused, so no rank builds its kernels: {refused}"
        )
    answer: dict[str, Any] | None = None
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        answer, failure = resolve_requests([rank[0] for rank in gathered])
    shared: dict[str, Any] = comm.broadcast_object(answer, group)
    if failure is not None:
        raise failure
    if "error" in shared:
        raise BackendDecisionError(
            f"rank 0 failed to decide the kernels' backends, so no rank builds its kernels: "
            f"{shared['error']}"
        )
    adopted = {
        k: BackendDecision.from_json({**v, "reason": f"shared by rank 0 ({v['reason']})"})
        for k, v in shared["decisions"].items()
    }
    default_resolver().adopt(adopted)
    return adopted
