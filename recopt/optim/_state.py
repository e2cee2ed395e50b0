"""KeyedOptimizer internals: strict two-phase state loading, structure checks, init_state,
and the hook tables of optimizers that skip ``torch.optim.Optimizer.__init__``.

`check_value` validates a loaded value against the live one without touching anything, so a
bad checkpoint fails before any state changes; `copy_value` then copies tensors in place
(ShardedTensors shard by shard) and replaces Python values.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

if TYPE_CHECKING:
    from recopt.optim.keyed import KeyedOptimizer

_STATE_DICT_KEYS = frozenset({"state", "param_groups"})


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Gives ``optimizer`` the empty hook tables ``torch.optim.Optimizer.__init__`` would, and
    patches its ``step`` so that ``register_step_pre_hook``/``post_hook`` take effect (for
    optimizers that do not call that ``__init__``, and after unpickling, which drops them)."""
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    optimizer._patch_step_function()


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is saved through its ``state_dict()`` and loaded through its
    ``load_state_dict()`` (an object kept in optimizer state, as TorchRec allows)."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _kind(value: Any) -> str:
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if is_stateful(value):
        return "stateful object"
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
    if kind == "stateful object":
        # Saved as its state_dict(): the loaded value must have that one's layout.
        check_value(f"{where} ({type(current).__name__})", current.state_dict(), new)
        return
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
    if is_stateful(current):
        current.load_state_dict(new)
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
    if is_stateful(value):
        return export_value(value.state_dict())
    if isinstance(value, dict):
        return {k: export_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [export_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(export_value(v) for v in value)
    return copy.deepcopy(value)


def describe(names: Iterable[str], limit: int = 4) -> str:
    """A short sorted listing of names for error messages."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def top_level_state(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict["state"]`` after checking the state dict's top-level layout."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict:
        raise ValueError(
            "state_dict must be a mapping with a 'state' entry (from KeyedOptimizer.state_dict())"
        )
    extra = set(state_dict) - _STATE_DICT_KEYS
    if extra:
        raise ValueError(
            f"state_dict has unknown top-level keys {describe(map(str, extra))}; "
            "expected 'state' and optionally 'param_groups'"
        )
    new_state = state_dict["state"]
    if not isinstance(new_state, Mapping):
        raise ValueError(
            f"state_dict['state'] must be a mapping name -> state, got {type(new_state).__name__}"
        )
    return new_state


def saved_param_groups(state_dict: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``state_dict["param_groups"]`` after checking it is a list of groups with ``params``.

    Raises:
        ValueError: the entry is missing or not a list, or a group is not a mapping or has
            no ``params`` list.
    """
    if "param_groups" not in state_dict:
        raise ValueError(
            "state_dict has no 'param_groups' entry; load a state_dict from the optimizer's "
            "state_dict()"
        )
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)):
        raise ValueError(
            f"state_dict['param_groups'] must be a list of groups, got {type(groups).__name__}"
        )
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(
                f"state_dict['param_groups'][{i}] must be a mapping with a 'params' list; "
                f"got {group!r:.80}"
            )
    return list(groups)


def validate_structure(
    params: Mapping[str, Any], state: Mapping[Any, Any], groups: Sequence[Mapping[str, Any]]
) -> None:
    """Raise ValueError unless every state key and group parameter is one of ``params``."""
    names_by_id: dict[int, str] = {}
    for name, p in params.items():
        if not isinstance(p, torch.Tensor):
            raise ValueError(
                f"params['{name}'] must be a Tensor or ShardedTensor, got {type(p).__name__}"
            )
        if id(p) in names_by_id:
            raise ValueError(
                f"params '{names_by_id[id(p)]}' and '{name}' are the same tensor; "
                "give each tensor one name"
            )
        names_by_id[id(p)] = name
    for key in state:
        if id(key) not in names_by_id:
            raise ValueError(
                f"All state keys must be params: state key {key!r:.60} is not in params; "
                "keep non-parameter state in an attribute of the optimizer instead"
            )
    for i, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param_groups[{i}] has no 'params' entry")
        for p in group["params"]:
            if id(p) not in names_by_id:
                raise ValueError(
                    f"param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not "
                    "in params; add it to params under a name"
                )


def _zero_grad_like(p: torch.Tensor, sparse: bool) -> torch.Tensor:
    if not sparse:
        return torch.zeros_like(p)
    # An empty sparse gradient, shaped like nn.Embedding(sparse=True) produces (rows sparse).
    indices = torch.empty((1, 0), dtype=torch.long, device=p.device)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=False)


def zero_grad_step(
    opt: KeyedOptimizer,
    grouped: list[torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    sparse: set[str],
) -> None:
    """One step of ``opt`` on zero gradients of ``targets`` that changes no weight or count.

    Other parameters get no gradient (torch optimizers skip them); weight decay is off during
    the step; weights, pending gradients and decay are restored and ``step`` counters reset
    after it; targets that had no gradient keep the zero one.
    """
    saved_grads = [(p, p.grad) for p in grouped]
    saved_weights = [(p, p.detach().clone()) for p in targets.values()]
    saved_decay = [(g, g["weight_decay"]) for g in opt.param_groups if "weight_decay" in g]
    stepped = False
    try:
        for p in grouped:
            p.grad = None  # torch optimizers skip parameters without gradient
        for name, p in targets.items():
            p.grad = _zero_grad_like(p, name in sparse)
        for group, _ in saved_decay:
            # Decay would otherwise move weights (AdamW) or leak p into state (SGD momentum).
            group["weight_decay"] = 0.0
        opt._raw_step()
        stepped = True
    finally:
        for group, decay in saved_decay:
            group["weight_decay"] = decay
        target_ids = {id(t) for t in targets.values()}
        for p, grad in saved_grads:
            # A target without a gradient keeps the zero one (TorchRec's init_state leaves it,
            # sparse where asked); pending gradients are restored (all, when the step failed).
            if grad is not None or id(p) not in target_ids or not stepped:
                p.grad = grad
        with torch.no_grad():
            for p, weight in saved_weights:
                p.copy_(weight)
    for p in targets.values():
        state = opt.state.get(p)
        if isinstance(state, dict) and "step" in state:
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step.zero_()
            else:
                state["step"] = type(step)(0)
