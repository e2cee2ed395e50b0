"""What goes into a checkpoint: state trees split into tensors (for DCP) and a JSON skeleton.

A state tree (model state dict, name-keyed optimizer state, extras) is encoded as JSON in which
every tensor is replaced by a reference to its flat DCP key (``model/<fqn>``,
``optim/state/<param>/<state>``); everything else must be JSON-representable, so loading never
unpickles. Also here: index-keyed torch optimizers made name-keyed, and RNG capture/restore.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.utils.serialization.config
from torch.distributed._shard.sharded_tensor import ShardedTensor


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read: corrupt, incomplete, or for another model."""


@runtime_checkable
class Stateful(Protocol):
    """An object saved through ``state_dict()`` and restored in place by ``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


TensorLike = torch.Tensor | ShardedTensor
JSON = Any  # a JSON-representable value (the skeleton)

# One tag per node kind, so that user dicts with any keys can never be mistaken for markers.
_TENSOR, _DICT, _LIST, _TUPLE, _VALUE = "t", "d", "l", "u", "v"
_SCALARS = (bool, int, float, str, type(None))


def encode_tree(tree: Any, path: str, tensors: dict[str, TensorLike]) -> JSON:
    """Encode ``tree`` as tagged JSON, moving every tensor into ``tensors`` under its path.

    Args:
        tree: nested dicts (str or int keys), lists, tuples, scalars, tensors, ShardedTensors.
        path: the key prefix of this subtree; components are joined with ``/``.
        tensors: receives ``path -> tensor`` for every tensor found.

    Returns:
        The JSON skeleton of ``tree``.

    Raises:
        CheckpointError: a value that is neither a tensor nor JSON-representable, or two
            tensors at the same path.
    """
    if isinstance(tree, torch.Tensor | ShardedTensor):
        if path in tensors:
            raise CheckpointError(f"two tensors map to the checkpoint key {path!r}")
        tensors[path] = tree
        return {_TENSOR: path}
    if isinstance(tree, Mapping):
        items = []
        for key, value in tree.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise CheckpointError(f"{path}: dict key {key!r} must be a str or int")
            items.append([key, encode_tree(value, _join(path, key), tensors)])
        return {_DICT: items}
    if isinstance(tree, list | tuple):
        encoded = [encode_tree(v, _join(path, i), tensors) for i, v in enumerate(tree)]
        return {_TUPLE if isinstance(tree, tuple) else _LIST: encoded}
    if isinstance(tree, _SCALARS):
        return {_VALUE: tree}
    raise CheckpointError(
        f"{path}: cannot checkpoint a {type(tree).__name__}; use tensors, numbers, strings, "
        "lists and dicts (or an object with state_dict/load_state_dict returning those)"
    )


def _join(path: str, key: str | int) -> str:
    return f"{path}/{key}" if path else str(key)


def decode_tree(node: JSON, tensors: Mapping[str, TensorLike]) -> Any:
    """Rebuild the tree encoded by `encode_tree`, taking tensors from ``tensors`` by path."""
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointError(f"malformed checkpoint skeleton node {str(node)[:80]!r}")
    ((tag, body),) = node.items()
    if tag == _TENSOR:
        return tensors[body]
    if tag == _DICT:
        return {key: decode_tree(value, tensors) for key, value in body}
    if tag == _LIST:
        return [decode_tree(v, tensors) for v in body]
    if tag == _TUPLE:
        return tuple(decode_tree(v, tensors) for v in body)
    if tag == _VALUE:
        return body
    raise CheckpointError(f"unknown checkpoint skeleton tag {tag!r}")


def check_skeleton(node: JSON, where: str, depth: int = 0) -> None:
    """Check that ``node`` is a skeleton as `encode_tree` writes it, before anything reads it.

    A skeleton holds only tagged nodes: a tensor's key (str), a dict's ``[key, node]`` pairs
    (str or int keys), a list's or tuple's nodes, a JSON scalar. The top is a dict node.

    Raises:
        CheckpointError: naming the first malformed node's path in ``where``.
    """
    problem = _skeleton_problem(node, "", depth)
    if problem is None and not (isinstance(node, dict) and _DICT in node):
        problem = "(top): not a dict node"
    if problem is not None:
        raise CheckpointError(
            f"{where} is not a recopt checkpoint skeleton: {problem}; the checkpoint is "
            "damaged or was not written by recopt: use another one"
        )


_MAX_DEPTH = 200  # far deeper than any state tree; stops a forged one from exhausting the stack


def _skeleton_problem(node: JSON, path: str, depth: int) -> str | None:
    """The first malformed node under ``node`` (as ``"path: what"``), or ``None``."""
    here = path or "(top)"
    if depth > _MAX_DEPTH:
        return f"{here}: nested deeper than {_MAX_DEPTH}"
    if not isinstance(node, dict) or len(node) != 1:
        return f"{here}: {str(node)[:60]!r} is not a one-tag node"
    ((tag, body),) = node.items()
    if tag == _TENSOR:
        return None if isinstance(body, str) else f"{here}: tensor key {body!r} is not a str"
    if tag == _VALUE:
        return None if isinstance(body, _SCALARS) else f"{here}: value {body!r} is not a scalar"
    if tag not in (_DICT, _LIST, _TUPLE):
        return f"{here}: unknown checkpoint skeleton tag {tag!r}"
    if not isinstance(body, list):
        return f"{here}: {tag!r} holds a {type(body).__name__}, not a list"
    for index, item in enumerate(body):
        if tag != _DICT:
            key: Any = index
        elif (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str | int)
            and not isinstance(item[0], bool)
        ):
            key, item = item
        else:
            return f"{here}: entry {str(item)[:60]!r} is not a [str or int key, node] pair"
        problem = _skeleton_problem(item, _join(path, key), depth + 1)
        if problem is not None:
            return problem
    return None


def subtree(node: JSON, key: str | int) -> JSON | None:
    """The encoded child ``key`` of an encoded dict node, or ``None`` if absent."""
    for k, value in node.get(_DICT, []):
        if k == key:
            return value
    return None


# ---------------------------------------------------------------------------------------------
# Optimizers: torch's state_dict is keyed by parameter index, which changes with the order the
# parameters were given in; checkpoints key it by parameter name instead.


def _is_index_keyed(state_dict: Mapping[str, Any]) -> bool:
    groups = state_dict.get("param_groups", [])
    return any(isinstance(k, int) for k in state_dict.get("state", {})) or any(
        isinstance(p, int) for g in groups for p in g.get("params", [])
    )


def _ordered_param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; build the optimizer from model.parameters()"
                )
            ordered.append(names[id(p)])
    return ordered


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name (KeyedOptimizers already are)."""
    state_dict = optimizer.state_dict()
    if not _is_index_keyed(state_dict):
        return state_dict
    names = _ordered_param_names(optimizer, model)
    return {
        **state_dict,
        "state": {names[i]: s for i, s in state_dict["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]
        ],
    }


def to_optimizer_keys(
    named: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """Undo `optimizer_state_dict`'s renaming for ``optimizer`` (index-keyed if it is).

    torch matches saved groups to live ones by position, so each group's indices are listed
    in the live optimizer's order; the names in each group must be the same set.

    Raises:
        CheckpointError: the checkpoint's parameters or groups differ from this optimizer's.
    """
    if not _is_index_keyed(optimizer.state_dict()):
        return named
    names = _ordered_param_names(optimizer, model)
    index = {name: i for i, name in enumerate(names)}
    live_groups, start = [], 0
    for group in optimizer.param_groups:
        live_groups.append(names[start : start + len(group["params"])])
        start += len(group["params"])
    saved_groups = named.get("param_groups", [])
    saved_sets = [sorted(g["params"]) for g in saved_groups]
    live_sets = [sorted(g) for g in live_groups]
    unknown = sorted(set(named.get("state", {})) - set(index))
    if saved_sets != live_sets or unknown:
        raise CheckpointError(
            f"the checkpoint's optimizer has parameter groups {saved_sets} (state for "
            f"{unknown or 'known'} parameters), this optimizer has {live_sets}; build the "
            "optimizer over the same parameters and groups as the one that was saved"
        )
    return {
        **named,
        "state": {index[n]: s for n, s in named.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [index[n] for n in live]}
            for g, live in zip(saved_groups, live_groups, strict=True)
        ],
    }


# ---------------------------------------------------------------------------------------------
# Random number generators (per rank; JSON so that loading needs no unpickling).


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and (if initialised) CUDA generator states."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s.cpu()) for s in torch.cuda.get_rng_state_all()]
    return state


def check_rank_state(state: Any, where: str) -> None:
    """Check the shape of a rank file (``{"rank": r, "rng": capture_rng()}``) before use.

    Raises:
        CheckpointError: naming ``where`` and what is wrong.
    """
    rng = state.get("rng") if isinstance(state, dict) else None
    ok = isinstance(rng, dict)
    if isinstance(rng, dict):
        python, numpy = rng.get("python"), rng.get("numpy")
        ok = (
            isinstance(python, list)
            and len(python) == 3
            and isinstance(python[1], list)
            and isinstance(numpy, list)
            and len(numpy) == 5
            and isinstance(numpy[1], list)
            and isinstance(rng.get("torch"), str)
            and isinstance(rng.get("cuda", []), list)
        )
    if not ok:
        raise CheckpointError(
            f"{where} does not hold a rank's RNG state as recopt writes it; the checkpoint is "
            "damaged or was not written by recopt: use another one"
        )


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the generators to a state returned by `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU of the saving process's host: a host with fewer GPUs (a checkpoint
        # of an 8-GPU node resumed on one) restores the ones it has, not an invalid ordinal.
        for index, encoded in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(encoded), index)


def global_shape(t: TensorLike) -> list[int]:
    """The full (unsharded) shape of a tensor or ShardedTensor."""
    return list(t.size())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


def tensor_dtype(t: TensorLike) -> torch.dtype:
    """The element type of a tensor or ShardedTensor."""
    if isinstance(t, ShardedTensor):
        return t.metadata().tensor_properties.dtype
    return t.dtype


@contextmanager
def archive_crc_off() -> Iterator[None]:
    """Let ``torch.save`` skip its zip CRC-32 (process-wide, restored on exit).

    miniz's CRC runs at about half the speed of the write itself, and it is redundant here:
    the manifest holds a zlib CRC-32 of every whole file, checked before every load.
    """
    config = torch.utils.serialization.config.save
    previous = config.compute_crc32
    config.compute_crc32 = False
    try:
        yield
    finally:
        config.compute_crc32 = previous
