"""What a healing state is: each rank's local shards as plain tensors, and the checks on it.

Sharded state travels as each rank's local shards (`to_local_shards` / `into_local_shards`):
rank r of a replica group heals from rank r of its source group, which holds the same shards.
A healer refuses a state that holds NaN or inf (`nonfinite_paths`, `HealingRefused`); the
transport (`recopt.ft.tensor_transport`) also checks its digest and carries tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

# Marks a ShardedTensor's local shards in a transferred state (plain tensors only).
LOCAL_SHARDS = "__recopt_local_shards__"


class HealingRefused(ValueError):
    """A healing state that must not be loaded: altered in transit, or not finite."""


def nonfinite_paths(value: Any, path: str = "") -> list[str]:
    """Paths (``a/b/0``) of the floating-point tensors in ``value`` that hold NaN or inf."""
    if isinstance(value, torch.Tensor):
        floating = value.is_floating_point() or value.is_complex()
        return [path or "."] if floating and not bool(torch.isfinite(value).all()) else []
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        found += nonfinite_paths(item, f"{path}/{key}" if path else str(key))
    return found


def to_local_shards(value: Any) -> Any:
    """``value`` with every ShardedTensor replaced by its local shards' plain tensors.

    The result loads with ``torch.load(weights_only=True)``; `into_local_shards` puts it back.
    """
    if isinstance(value, ShardedTensor):
        return {LOCAL_SHARDS: [shard.tensor for shard in value.local_shards()]}
    if isinstance(value, dict):
        return {k: to_local_shards(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_local_shards(v) for v in value)
    return value


@torch.no_grad()
def into_local_shards(received: Any, current: Any) -> Any:
    """Copy the local shards in ``received`` into the ShardedTensors of ``current``.

    Args:
        received: a state from `to_local_shards` (of the same rank of a group with the same
            sharding plan).
        current: this rank's own state of the same structure (e.g. ``model.state_dict()``),
            whose ShardedTensors are views of the live shards.

    Returns:
        ``received`` with each local-shard entry replaced by the (now updated) ShardedTensor
        of ``current``, ready for ``load_state_dict``.

    Raises:
        ValueError: the local shards differ in number or shape (not the same plan or rank).
    """
    if isinstance(received, dict) and LOCAL_SHARDS in received:
        if not isinstance(current, ShardedTensor):
            raise ValueError(
                "healing state holds local shards where this rank's state has no ShardedTensor; "
                "every replica group must use the same sharding plan"
            )
        mine = [shard.tensor for shard in current.local_shards()]
        theirs = received[LOCAL_SHARDS]
        if [t.shape for t in mine] != [t.shape for t in theirs]:
            raise ValueError(
                f"healing source's local shards {[tuple(t.shape) for t in theirs]} differ from "
                f"this rank's {[tuple(t.shape) for t in mine]}; every replica group must use "
                "the same sharding plan and group size"
            )
        for dst, src in zip(mine, theirs, strict=True):
            dst.copy_(src)
        return current
    if isinstance(received, dict):
        mapping: dict[Any, Any] = current if isinstance(current, dict) else {}
        return {k: into_local_shards(v, mapping.get(k)) for k, v in received.items()}
    if isinstance(received, list | tuple):
        same = isinstance(current, list | tuple) and len(current) == len(received)
        peers: Sequence[Any] = current if same else [None] * len(received)
        return type(received)(into_local_shards(v, c) for v, c in zip(received, peers, strict=True))
    return received
