"""Strict, two-phase loading of optimizer state values (tensors, ShardedTensors, nested).

`check_value` validates a loaded value against the live one without touching anything, so
a bad checkpoint fails before any state changes; `copy_value` then copies tensors in place
(ShardedTensors shard by shard) and replaces Python values.
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor


def _kind(value: Any) -> str:
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "python value"


def check_value(where: str, current: Any, new: Any) -> None:
    """Raise if ``new`` cannot be loaded into ``current`` exactly (kind, keys, shape, dtype).

    Args:
        where: names the parameter and state key for the error message.
        current: the live state value.
        new: the value from the state dict.

    Raises:
        ValueError: naming ``where`` and what differs.
    """
    kind, new_kind = _kind(current), _kind(new)
    if kind != new_kind:
        raise ValueError(
            f"{where}: the optimizer holds a {kind} but the state_dict has a {new_kind}; "
            "load a state_dict saved by the same optimizer configuration"
        )
    if kind == "ShardedTensor":
        _check_sharded(where, current, new)
    elif kind == "tensor":
        _check_tensor(where, current, new)
    elif kind == "dict":
        if set(current) != set(new):
            missing = sorted(map(str, set(current) - set(new)))
            extra = sorted(map(str, set(new) - set(current)))
            raise ValueError(
                f"{where}: state keys differ (missing from state_dict: {missing}, "
                f"unknown in state_dict: {extra}); load a state_dict of the same optimizer type"
            )
        for key in current:
            check_value(f"{where}.{key}", current[key], new[key])
    elif kind == "sequence":
        if len(current) != len(new):
            raise ValueError(
                f"{where}: the optimizer holds {len(current)} entries but the state_dict has "
                f"{len(new)}; load a state_dict of the same optimizer configuration"
            )
        for i, (cur, nxt) in enumerate(zip(current, new, strict=True)):
            check_value(f"{where}[{i}]", cur, nxt)


def _check_tensor(where: str, current: torch.Tensor, new: torch.Tensor) -> None:
    if current.shape != new.shape:
        raise ValueError(
            f"{where}: shape {tuple(new.shape)} in the state_dict does not match the "
            f"optimizer's {tuple(current.shape)}; it is never broadcast, save and load with "
            "the same parameter shapes (or reshard the checkpoint first)"
        )
    if current.dtype != new.dtype:
        raise ValueError(
            f"{where}: dtype {new.dtype} in the state_dict does not match the optimizer's "
            f"{current.dtype}; convert the state_dict's tensor to {current.dtype} first"
        )


def _check_sharded(where: str, current: ShardedTensor, new: ShardedTensor) -> None:
    if current.size() != new.size():
        raise ValueError(
            f"{where}: global shape {tuple(new.size())} in the state_dict does not match the "
            f"optimizer's {tuple(current.size())}"
        )
    shards, new_shards = current.local_shards(), new.local_shards()
    if len(shards) != len(new_shards):
        raise ValueError(
            f"{where}: {len(new_shards)} local shards in the state_dict but the optimizer "
            f"holds {len(shards)} on this rank; load with the same sharding (or reshard)"
        )
    for i, (shard, new_shard) in enumerate(zip(shards, new_shards, strict=True)):
        offsets, new_offsets = shard.metadata.shard_offsets, new_shard.metadata.shard_offsets
        if list(offsets) != list(new_offsets):
            raise ValueError(
                f"{where}: local shard {i} starts at {list(new_offsets)} in the state_dict but "
                f"at {list(offsets)} in the optimizer; load with the same sharding (or reshard)"
            )
        _check_tensor(f"{where} (local shard {i})", shard.tensor, new_shard.tensor)


def copy_value(current: Any, new: Any) -> Any:
    """Load ``new`` into ``current`` (already checked) and return the value to keep.

    Tensors are copied in place (so views held elsewhere, e.g. by a kernel, see the load);
    containers are updated in place; Python values are replaced by a deep copy.
    """
    if isinstance(current, ShardedTensor):
        for shard, new_shard in zip(current.local_shards(), new.local_shards(), strict=True):
            with torch.no_grad():
                shard.tensor.detach().copy_(new_shard.tensor)
        return current
    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.detach().copy_(new)
        return current
    if isinstance(current, MutableMapping):
        for key in list(current):
            current[key] = copy_value(current[key], new[key])
        return current
    if isinstance(current, MutableSequence):
        for i in range(len(current)):
            current[i] = copy_value(current[i], new[i])
        return current
    if isinstance(current, tuple):
        return tuple(copy_value(c, n) for c, n in zip(current, new, strict=True))
    return copy.deepcopy(new)


def export_value(value: Any) -> Any:
    """The state_dict form of a state value: containers copied, tensors by reference.

    Tensors are shared, not cloned, so that a checkpoint loader can write into them in place
    (the point of KeyedOptimizer's in-place loading); clone them for a snapshot.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: export_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [export_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(export_value(v) for v in value)
    return copy.deepcopy(value)
