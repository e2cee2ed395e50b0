"""Registers the sparse types with ``torch.utils._pytree`` (and ``torch.fx._pytree``'s flatten
specs), in TorchRec's layout: ``tree_map`` / ``tree_flatten`` (and the tools built on them)
see through a KeyedJaggedTensor, JaggedTensor or KeyedTensor to its tensors and rebuild it.

Leaves, as TorchRec's: a KJT's ``[values, weights, lengths, offsets, stride_per_key_per_rank,
inverse_indices]`` (absent ones are None leaves; a function given to ``tree_map`` sees them),
a JT's ``[values, weights, lengths, offsets]``, a KT's ``[values]``. A KJT built from offsets
alone comes back with ``lengths_or_none() is None``; a spec cut short (fewer leaves) leaves the
missing parts out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from recopt.sparse.jagged import JaggedTensor
from recopt.sparse.keyed import KeyedTensor, regroup
from recopt.sparse.keyed_jagged import KeyedJaggedTensor

_Leaves = list[torch.Tensor | None]
_KJT_LEAVES = 6
_JT_LEAVES = 4


def _kjt_leaves(kjt: KeyedJaggedTensor) -> _Leaves:
    per_rank = kjt._stride_per_key_per_rank
    inverse = kjt.inverse_indices_or_none()
    return [
        kjt.values(),
        kjt.weights_or_none(),
        kjt.lengths_or_none(),
        kjt.offsets_or_none(),
        None if per_rank is None else torch.tensor(per_rank, dtype=torch.int64),
        None if inverse is None else inverse[1],
    ]


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[_Leaves, Any]:
    return _kjt_leaves(kjt), list(kjt.keys())


def _padded(leaves: Any, count: int, what: str) -> _Leaves:
    leaves = list(leaves)
    if len(leaves) > count:
        raise ValueError(f"{what} takes at most {count} leaves, got {len(leaves)}")
    return leaves + [None] * (count - len(leaves))


def _kjt_unflatten(leaves: Any, keys: list[str]) -> KeyedJaggedTensor:
    values, weights, lengths, offsets, per_rank, inverse = _padded(
        leaves, _KJT_LEAVES, "KeyedJaggedTensor"
    )
    assert values is not None
    return KeyedJaggedTensor(
        list(keys),
        values,
        weights,
        lengths,
        offsets,
        stride_per_key_per_rank=per_rank,
        inverse_indices=None if inverse is None else (list(keys), inverse),
    )


def _jt_flatten(jt: JaggedTensor) -> tuple[_Leaves, Any]:
    return [jt.values(), jt.weights_or_none(), jt.lengths(), jt.offsets_or_none()], None


def _jt_unflatten(leaves: Any, context: Any) -> JaggedTensor:
    values, weights, lengths, offsets = _padded(leaves, _JT_LEAVES, "JaggedTensor")
    assert values is not None
    return JaggedTensor(values, weights, lengths, offsets)


def _kt_flatten(kt: KeyedTensor) -> tuple[_Leaves, Any]:
    return [kt.values()], (list(kt.keys()), list(kt.length_per_key()), kt.key_dim())


def _kt_unflatten(leaves: Any, context: Any) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    return KeyedTensor(list(keys), list(length_per_key), list(leaves)[0], key_dim)


def _kt_flatten_spec(kt: KeyedTensor, spec: pytree.TreeSpec) -> list[torch.Tensor]:
    """The values in the spec's key order (an exported program's KT may hold another)."""
    keys = list(spec.context[0])
    return [kt.values() if kt.keys() == keys else regroup([kt], [keys])[0]]


def register() -> None:
    """Register the three types (once; called when `recopt.sparse` is imported)."""
    for cls, flatten, unflatten, flatten_spec in (
        (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten, lambda t, s: _kjt_leaves(t)),
        (JaggedTensor, _jt_flatten, _jt_unflatten, lambda t, s: _jt_flatten(t)[0]),
        (KeyedTensor, _kt_flatten, _kt_unflatten, _kt_flatten_spec),
    ):
        if cls in pytree.SUPPORTED_NODES:
            continue
        pytree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        )
        fx_pytree.register_pytree_flatten_spec(cls, flatten_spec)
