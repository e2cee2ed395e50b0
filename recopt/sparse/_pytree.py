"""Registers the sparse types with ``torch.utils._pytree``, as TorchRec does: ``tree_map`` /
``tree_flatten`` (and the tools built on them) see through a KeyedJaggedTensor, JaggedTensor or
KeyedTensor to its tensors and rebuild it around the transformed ones, without re-checking
them (the layout is the original's)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from recopt.sparse.jagged import JaggedTensor
from recopt.sparse.keyed import KeyedTensor
from recopt.sparse.keyed_jagged import KeyedJaggedTensor

_Children = list[torch.Tensor | None]


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[_Children, Any]:
    inverse = kjt.inverse_indices_or_none()
    children: _Children = [
        kjt.values(),
        kjt.weights_or_none(),
        kjt.lengths(),
        None if inverse is None else inverse[1],
    ]
    context = (
        tuple(kjt.keys()),
        tuple(kjt.stride_per_key()),
        kjt._stride,
        kjt._stride_per_key_per_rank,
        kjt._length_per_key,
        None if inverse is None else tuple(inverse[0]),
    )
    return children, context


def _kjt_unflatten(children: _Children, context: Any) -> KeyedJaggedTensor:
    keys, stride_per_key, stride, per_rank, length_per_key, inverse_keys = context
    values, weights, lengths, inverse = children
    assert values is not None and lengths is not None
    return KeyedJaggedTensor._trusted(
        list(keys),
        values,
        weights,
        lengths,
        list(stride_per_key),
        length_per_key,
        per_rank=per_rank,
        stride=stride,
        inverse_indices=None if inverse is None else (list(inverse_keys), inverse),
    )


def _jt_flatten(jt: JaggedTensor) -> tuple[_Children, Any]:
    return [jt.values(), jt.weights_or_none(), jt.lengths()], None


def _jt_unflatten(children: _Children, context: Any) -> JaggedTensor:
    values, weights, lengths = children
    assert values is not None and lengths is not None
    return JaggedTensor._trusted(values, lengths, weights)


def _kt_flatten(kt: KeyedTensor) -> tuple[_Children, Any]:
    return [kt.values()], (tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim())


def _kt_unflatten(children: _Children, context: Any) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    assert children[0] is not None
    return KeyedTensor(list(keys), list(length_per_key), children[0], key_dim)


def register() -> None:
    """Register the three types (once; called when `recopt.sparse` is imported)."""
    for cls, flatten, unflatten in (
        (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten),
        (JaggedTensor, _jt_flatten, _jt_unflatten),
        (KeyedTensor, _kt_flatten, _kt_unflatten),
    ):
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(
                cls,
                flatten,
                unflatten,  # type: ignore[arg-type]
                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            )
