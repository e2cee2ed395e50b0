"""Helpers of KeyedJaggedTensor kept out of its class file: the operations that regroup its
keys (split, permute with its sync-free reorder, concat), each building its result from parts
already valid (``_trusted``), and the readable text forms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from recopt.sparse._checks import exclusive_cumsum
from recopt.sparse.jagged import _REPR_MAX_IDS, _bags_text

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
    return type(first)._trusted(
        [key for kjt in kjts for key in kjt.keys()],
        torch.cat([kjt.values() for kjt in kjts]),
        weights,
        torch.cat([kjt.lengths() for kjt in kjts]),
        [s for kjt in kjts for s in kjt.stride_per_key()],
        [n for kjt in kjts for n in kjt.length_per_key()] if known else None,
        per_rank=per_rank,
        stride=None if variable else max(kjt.stride() for kjt in kjts),
    )


def split_kjt(kjt: KeyedJaggedTensor, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
    """Splits the keys into consecutive groups, as views (see ``KeyedJaggedTensor.split``)."""
    segments = list(segments)
    for size in segments:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"split: segment sizes must be non-negative ints, got {size!r}")
    if sum(segments) != len(kjt):
        raise ValueError(
            f"split: segments {segments} sum to {sum(segments)} but there are {len(kjt)} keys"
        )
    opk, lpk, bpk = kjt.offset_per_key(), kjt.length_per_key(), kjt._bag_offset_per_key
    rows, weights = kjt._stride_per_key_per_rank, kjt._weights
    parts, first = [], 0
    for size in segments:
        last = first + size
        start, end = opk[first], opk[last]
        part = type(kjt)._trusted(
            kjt._keys[first:last],
            kjt._values[start:end],
            None if weights is None else weights[start:end],
            kjt._lengths[bpk[first] : bpk[last]],
            kjt._stride_per_key[first:last],
            lpk[first:last],
            per_rank=None if rows is None else rows[first:last],
            stride=kjt.stride(),
        )
        parts.append(part)
        first = last
    return parts


def permute_kjt(kjt: KeyedJaggedTensor, indices: Sequence[int]) -> KeyedJaggedTensor:
    """Returns a KJT whose key ``i`` is ``kjt``'s key ``indices[i]`` (see
    ``KeyedJaggedTensor.permute``)."""
    indices = list(indices)
    num_keys = len(kjt)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_keys:
            raise ValueError(f"permute: index {index!r} is not in range({num_keys}) of the keys")
    if kjt.length_per_key_or_none() is None and sorted(indices) == list(range(num_keys)):
        return reorder_on_device(kjt, indices)
    opk, lpk = kjt.offset_per_key(), kjt.length_per_key()

    def gather(t: torch.Tensor, cuts: Sequence[int]) -> torch.Tensor:
        if not indices:
            return t[:0]
        return torch.cat([t[cuts[i] : cuts[i + 1]] for i in indices])

    rows, weights = kjt._stride_per_key_per_rank, kjt._weights
    return type(kjt)._trusted(
        [kjt._keys[i] for i in indices],
        gather(kjt._values, opk),
        None if weights is None else gather(weights, opk),
        gather(kjt._lengths, kjt._bag_offset_per_key),
        [kjt._stride_per_key[i] for i in indices],
        [lpk[i] for i in indices],
        per_rank=None if rows is None else [rows[i] for i in indices],
        stride=kjt._stride,
        inverse_indices=kjt._inverse_indices,
    )


def map_tensors(
    kjt: KeyedJaggedTensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> KeyedJaggedTensor:
    """Applies ``fn`` to every tensor; keeps keys, batch sizes and cached counts."""
    inverse, weights, offsets = kjt._inverse_indices, kjt._weights, kjt._offsets
    return type(kjt)._trusted(
        list(kjt._keys),
        fn(kjt._values),
        None if weights is None else fn(weights),
        fn(kjt._lengths),
        list(kjt._stride_per_key),
        kjt._length_per_key,
        None if offsets is None else fn(offsets),
        per_rank=kjt._stride_per_key_per_rank,
        stride=kjt._stride,
        inverse_indices=None if inverse is None else (inverse[0], fn(inverse[1])),
    )


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
    return type(kjt)._trusted(
        [kjt._keys[i] for i in order],
        kjt._values.index_select(0, entry_index),
        None if weights is None else weights.index_select(0, entry_index),
        lengths,
        [kjt.stride_per_key()[i] for i in order],
        None,
        per_rank=None if rows is None else [rows[i] for i in order],
        stride=kjt._stride,
        inverse_indices=kjt._inverse_indices,
    )


def kjt_repr(kjt: KeyedJaggedTensor) -> str:
    """The developer's form: stride, weighted, and each key's bags (or, when large, counts)."""
    head = f"KeyedJaggedTensor(stride={kjt.stride()}, weighted={kjt._weights is not None}"
    if kjt._values.numel() > _REPR_MAX_IDS:
        counts = dict(zip(kjt._keys, kjt.length_per_key(), strict=True))
        return f"{head}, ids per key={counts})"
    features = [f"{key!r}: {_bags_text(kjt[key])}" for key in kjt._keys]
    return ",\n  ".join([head, *features]) + ")"
