"""``torchrec.sparse.jagged_tensor``: recopt's sparse types, plus the small helpers TorchRec
exports beside them (equality checks and the KJT <-> dict-of-JT modules)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from recopt.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recopt.sparse import regroup as regroup_kts

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "jt_is_equal",
    "kjt_is_equal",
    "regroup_kts",
]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """True when both hold the same values, lengths and weights (TorchRec's helper)."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    return (
        _same(jt_1.values(), jt_2.values())
        and _same(jt_1.lengths(), jt_2.lengths())
        and _same(jt_1.weights_or_none(), jt_2.weights_or_none())
    )


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """True when both have the same keys, bags per key, values, lengths and weights."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    return (
        kjt_1.keys() == kjt_2.keys()
        and kjt_1.stride_per_key() == kjt_2.stride_per_key()
        and _same(kjt_1.values(), kjt_2.values())
        and _same(kjt_1.lengths(), kjt_2.lengths())
        and _same(kjt_1.weights_or_none(), kjt_2.weights_or_none())
    )


class ComputeKJTToJTDict(nn.Module):
    """``forward(kjt) -> {key: JaggedTensor}``: `KeyedJaggedTensor.to_dict` as a module."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """``forward({key: JaggedTensor}) -> kjt``: `KeyedJaggedTensor.from_jt_dict` as a module."""

    def forward(self, jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)
