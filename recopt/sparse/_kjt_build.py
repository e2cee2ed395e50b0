"""KeyedJaggedTensor's TorchRec-compatible constructors from other data, kept out of its class
file: from Python id lists, from one JaggedTensor per feature, and the empty KJTs. Each checks
what its input can get wrong and builds through the class, so the class's checks still run
(the empty ones build trusted parts: they have nothing to check)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from recopt.sparse._checks import check_keys, check_values, resolve_stride

if TYPE_CHECKING:
    from recopt.sparse.jagged import JaggedTensor
    from recopt.sparse.keyed_jagged import KeyedJaggedTensor


def kjt_from_id_lists(
    cls: type[KeyedJaggedTensor],
    ids: Mapping[str, Sequence[Sequence[int]]],
    weights: Mapping[str, Sequence[Sequence[float]]] | None,
) -> KeyedJaggedTensor:
    """Builds from Python lists (see ``KeyedJaggedTensor.from_id_lists``)."""
    keys = check_keys(list(ids))
    stride = len(ids[keys[0]]) if keys else 0
    for key in keys:
        if len(ids[key]) != stride:
            raise ValueError(
                f"feature {key!r} has {len(ids[key])} samples but feature {keys[0]!r} has "
                f"{stride}; every feature needs one bag per sample"
            )
    lengths = [len(bag) for key in keys for bag in ids[key]]
    values = torch.tensor([i for key in keys for bag in ids[key] for i in bag], dtype=torch.int64)
    weights_flat = None if weights is None else flat_weights(ids, weights, keys, stride)
    lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
    return cls(keys, values, weights=weights_flat, lengths=lengths_tensor, stride=stride)


def flat_weights(
    ids: Mapping[str, Sequence[Sequence[int]]],
    weights: Mapping[str, Sequence[Sequence[float]]],
    keys: list[str],
    stride: int,
) -> torch.Tensor:
    """Checks that weights mirror ids bag by bag; returns them flat, key-major, float32."""
    if list(weights) != keys:
        raise ValueError(
            f"weights have features {list(weights)} but ids have {keys}; "
            "give weights for the same features, in the same order"
        )
    for key in keys:
        if len(weights[key]) != stride:
            raise ValueError(
                f"feature {key!r}: weights have {len(weights[key])} samples but ids have {stride}"
            )
        for sample, (bag, bag_weights) in enumerate(zip(ids[key], weights[key], strict=True)):
            if len(bag) != len(bag_weights):
                raise ValueError(
                    f"feature {key!r}, sample {sample}: {len(bag_weights)} weights for "
                    f"{len(bag)} ids; give one weight per id"
                )
    flat = [w for key in keys for bag in weights[key] for w in bag]
    return torch.tensor(flat, dtype=torch.float32)


def kjt_from_jt_dict(
    cls: type[KeyedJaggedTensor], jt_dict: Mapping[str, JaggedTensor]
) -> KeyedJaggedTensor:
    """Builds from one JaggedTensor per feature (see ``KeyedJaggedTensor.from_jt_dict``)."""
    keys = check_keys(list(jt_dict))
    if not keys:
        return cls.empty()
    first = keys[0]
    weighted = jt_dict[first].weights_or_none() is not None
    for key in keys:
        if (jt_dict[key].weights_or_none() is not None) != weighted:
            raise ValueError(
                f"feature {first!r} is {'' if weighted else 'un'}weighted but {key!r} is not; "
                "give weights to all features or to none"
            )
    jts = [jt_dict[key] for key in keys]
    strides = [jt.lengths().numel() for jt in jts]
    per_rank = None if len(set(strides)) == 1 else [[s] for s in strides]
    return cls(
        keys,
        torch.cat([jt.values() for jt in jts]),
        weights=torch.cat([jt.weights() for jt in jts]) if weighted else None,
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=strides[0] if per_rank is None else None,
        stride_per_key_per_rank=per_rank,
    )


def empty_kjt(
    cls: type[KeyedJaggedTensor],
    keys: Sequence[str],
    stride: int,
    device: torch.device | str | None,
    values_dtype: torch.dtype | None,
    weights_dtype: torch.dtype | None,
    is_weighted: bool,
) -> KeyedJaggedTensor:
    """Returns a KJT with no entries (see ``KeyedJaggedTensor.empty``)."""
    keys = check_keys(keys)
    resolve_stride(0, 0, stride, "empty")
    values = check_values(torch.empty(0, dtype=values_dtype or torch.int64, device=device))
    weights = (
        torch.empty(0, dtype=weights_dtype or torch.float32, device=device) if is_weighted else None
    )
    lengths = torch.zeros(len(keys) * stride, dtype=torch.int64, device=device)
    strides, counts = [stride] * len(keys), [0] * len(keys)
    return cls._trusted(keys, values, weights, lengths, strides, counts, stride=stride)


def empty_like_kjt(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """Returns ``kjt``'s keys, batch sizes, dtypes and device with no entries (see
    ``KeyedJaggedTensor.empty_like``)."""
    weights = kjt.weights_or_none()
    return type(kjt)._trusted(
        kjt.keys(),
        kjt.values()[:0],
        None if weights is None else weights[:0],
        torch.zeros_like(kjt.lengths()),
        kjt.stride_per_key(),
        [0] * len(kjt),
        per_rank=kjt._stride_per_key_per_rank,
        stride=kjt._stride,
    )
