"""Helpers of KeyedJaggedTensor kept out of its class file: concat, the sync-free reorder,
the readable text form, and the weights of ``from_id_lists``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from recopt.sparse._checks import exclusive_cumsum

if TYPE_CHECKING:
    from recopt.sparse.keyed_jagged import KeyedJaggedTensor


def concat_kjts(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Joins KJTs of the same batch (see ``KeyedJaggedTensor.concat``)."""
    if not kjts:
        raise ValueError("concat needs at least one KeyedJaggedTensor, got none")
    first = kjts[0]
    variable = any(kjt.variable_stride_per_key() for kjt in kjts)
    owner: dict[str, int] = {}
    for i, kjt in enumerate(kjts):
        if not variable and kjt.stride() != first.stride() and len(kjt) and len(first):
            raise ValueError(
                f"concat: input {i} has stride {kjt.stride()} but input 0 has {first.stride()}"
            )
        if (kjt.weights_or_none() is None) != (first.weights_or_none() is None):
            raise ValueError(
                f"concat: input {i} and input 0 differ in having weights; weight all or none"
            )
        for key in kjt.keys():
            if key in owner:
                raise ValueError(f"concat: key {key!r} is in input {owner[key]} and input {i}")
            owner[key] = i
    weights = None
    if first.weights_or_none() is not None:
        weights = torch.cat([kjt.weights() for kjt in kjts])
    known = all(kjt.length_per_key_or_none() is not None for kjt in kjts)
    per_rank = None
    if variable:
        per_rank = [row for kjt in kjts for row in kjt.stride_per_key_per_rank()]
    joined = type(first)._trusted(
        [key for kjt in kjts for key in kjt.keys()],
        torch.cat([kjt.values() for kjt in kjts]),
        weights,
        torch.cat([kjt.lengths() for kjt in kjts]),
        [s for kjt in kjts for s in kjt.stride_per_key()],
        [n for kjt in kjts for n in kjt.length_per_key()] if known else None,
        per_rank=per_rank,
    )
    joined._stride = None if variable else max(kjt.stride() for kjt in kjts)
    return joined


def kjt_text(kjt: KeyedJaggedTensor) -> str:
    """TorchRec's readable form: each key's bags (and weights) as nested lists."""
    if not kjt.keys():
        return "KeyedJaggedTensor()\n"
    parts = []
    for key, jt in kjt.to_dict().items():
        values = [bag.tolist() for bag in jt.to_dense()]
        weights = jt.to_dense_weights()
        if weights is None:
            parts.append(f'    "{key}": {values}')
            continue
        weight_lists = [bag.tolist() for bag in weights]
        parts.append(
            f'    "{key}": {{\n        "values": {values},\n'
            f'        "weights": {weight_lists}\n    }}'
        )
    return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"


def reorder_on_device(kjt: KeyedJaggedTensor, order: list[int]) -> KeyedJaggedTensor:
    """Reorders all keys with device ops only: the output holds exactly the input's entries,
    so every size is known on the host and nothing needs reading back."""
    device = kjt._lengths.device
    bpk = kjt._bag_offset_per_key
    source_bags = [b for i in order for b in range(bpk[i], bpk[i + 1])]
    bag_index = torch.tensor(source_bags, dtype=torch.int64, device=device)
    lengths = kjt._lengths.index_select(0, bag_index)
    num_entries = kjt._values.shape[0]
    new_bag_of_entry = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=num_entries
    )
    new_starts = exclusive_cumsum(lengths)[new_bag_of_entry]
    old_starts = kjt.offsets()[bag_index][new_bag_of_entry]
    entry_index = torch.arange(num_entries, device=device) - new_starts + old_starts
    weights = kjt._weights
    rows = kjt._stride_per_key_per_rank
    reordered = type(kjt)._trusted(
        [kjt._keys[i] for i in order],
        kjt._values.index_select(0, entry_index),
        None if weights is None else weights.index_select(0, entry_index),
        lengths,
        [kjt.stride_per_key()[i] for i in order],
        None,
        per_rank=None if rows is None else [rows[i] for i in order],
    )
    reordered._stride = kjt._stride
    reordered._inverse_indices = kjt._inverse_indices
    return reordered


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
