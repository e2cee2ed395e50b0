"""Validation of the jagged layout, shared by JaggedTensor, KeyedJaggedTensor, KeyedTensor.

Checks cost O(features) Python work plus about one reduction and one device sync; only on
failure do they search for the feature and bag at fault, so that the message can name them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_index_tensor(tensor: torch.Tensor, field: str) -> torch.Tensor:
    """Checks a 1-D integer tensor (lengths, offsets, ids) and returns it as int64."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{field} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{field} must be 1-D, got shape {list(tensor.shape)}; flatten it")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{field} must have an integer dtype, got {tensor.dtype}; use .long()")
    return tensor if tensor.dtype == torch.int64 else tensor.long()


def check_weights(weights: torch.Tensor | None, values: torch.Tensor) -> None:
    """Checks that optional weights are floating, one per id, on the ids' device."""
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise ValueError(f"weights must be floating point, got {weights.dtype}; use .float()")
    if weights.shape != values.shape:
        raise ValueError(
            f"weights has shape {list(weights.shape)} but values has {list(values.shape)}; "
            "give exactly one weight per id"
        )
    if weights.device != values.device:
        raise ValueError(f"weights are on {weights.device} but values on {values.device}")


def check_keys(keys: Sequence[str]) -> list[str]:
    """Checks that keys are unique strings; returns them as a new list."""
    if isinstance(keys, str):
        raise ValueError(f"keys must be a list of strings, got the string {keys!r}; use [{keys!r}]")
    keys = list(keys)
    seen: set[str] = set()
    for position, key in enumerate(keys):
        if not isinstance(key, str):
            raise ValueError(
                f"keys must be strings, got {key!r} ({type(key).__name__}) at position {position}"
            )
        if key in seen:
            raise ValueError(f"keys must be unique, but {key!r} appears more than once")
        seen.add(key)
    return keys


def describe_bag(keys: Sequence[str] | None, stride: int, index: int) -> str:
    """Names a (feature, bag) for an error message from its flat index into lengths."""
    if keys is None:
        return f"bag {index}"
    return f"feature {keys[index // stride]!r}, bag {index % stride}"


def lengths_from_offsets(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """Checks offsets' start and end (one sync) and returns their lengths (may be negative)."""
    if offsets.numel() == 0:
        raise ValueError("offsets must have at least one entry (offsets[0] = 0)")
    first, last = torch.stack([offsets[0], offsets[-1]]).tolist()
    if first != 0:
        raise ValueError(f"offsets start at {first} but must start at 0")
    if last != num_ids:
        raise ValueError(
            f"offsets end at {last} but values hold {num_ids} ids; "
            "the last offset must equal len(values)"
        )
    return offsets[1:] - offsets[:-1]


def validate_lengths(
    lengths: torch.Tensor,
    num_ids: int,
    keys: Sequence[str] | None,
    stride: int,
    from_offsets: bool,
) -> list[int]:
    """Checks lengths against values (one reduction, one sync); returns the ids per key.

    ``keys`` None means a single unnamed feature (a JaggedTensor). Only on failure does it
    look for the feature and bag at fault, to name them.
    """
    num_keys = 1 if keys is None else len(keys)
    if num_keys == 0:
        if num_ids != 0:
            raise ValueError(
                f"a KeyedJaggedTensor with no keys holds no ids, but values has {num_ids}"
            )
        return []
    per_key = lengths.view(num_keys, stride).sum(dim=1)
    lowest = lengths.min().view(1) if lengths.numel() else per_key.new_zeros(1)
    stats = torch.cat([per_key, lowest]).tolist()
    length_per_key, lowest_length = stats[:-1], stats[-1]
    if lowest_length < 0:
        bad = int((lengths < 0).nonzero()[0, 0])
        where, length = describe_bag(keys, stride, bad), int(lengths[bad])
        if from_offsets:
            raise ValueError(f"{where}: offsets decrease by {-length}; they must be non-decreasing")
        raise ValueError(f"{where}: length {length} is negative; lengths must be >= 0")
    total = sum(length_per_key)
    if total != num_ids:
        if keys is None:
            raise ValueError(
                f"lengths sum to {total} but values hold {num_ids} ids; they must match"
            )
        start = 0
        for key, count in zip(keys, length_per_key, strict=True):
            if start + count > num_ids or key == keys[-1]:
                raise ValueError(
                    f"feature {key!r}: lengths sum to {count} but it holds {num_ids - start} ids "
                    f"(values[{start}:{num_ids}]); lengths must sum to len(values) = {num_ids}"
                )
            start += count
    return length_per_key


def exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Returns offsets [N+1] from lengths [N]: 0, then the running sums."""
    offsets = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def resolve_lengths(
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
    keys: Sequence[str] | None,
    stride: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, list[int]]:
    """Validates lengths and/or offsets; returns (lengths, offsets, stride, length_per_key)."""
    num_ids = values.numel()
    num_keys = 1 if keys is None else len(keys)
    if lengths is None and offsets is None:
        raise ValueError("pass lengths or offsets (one count per bag); neither was given")
    if lengths is not None:
        lengths = as_index_tensor(lengths, "lengths")
    if offsets is not None:
        offsets = as_index_tensor(offsets, "offsets")
        if lengths is not None and offsets.numel() != lengths.numel() + 1:
            raise ValueError(
                f"offsets has {offsets.numel()} entries but lengths has {lengths.numel()}; "
                "offsets needs one more entry than lengths"
            )
    for name, tensor in (("lengths", lengths), ("offsets", offsets)):
        if tensor is not None and tensor.device != values.device:
            raise ValueError(f"{name} is on {tensor.device} but values on {values.device}")
    if lengths is not None:
        stride = resolve_stride(lengths.numel(), num_keys, stride, "lengths")
    else:
        assert offsets is not None
        stride = resolve_stride(max(offsets.numel() - 1, 0), num_keys, stride, "offsets")
    from_offsets = lengths is None
    if offsets is not None:
        derived = lengths_from_offsets(offsets, num_ids)
        if lengths is None:
            lengths = derived
        elif not torch.equal(derived, lengths):
            bad = int((derived != lengths).nonzero()[0, 0])
            raise ValueError(
                f"{describe_bag(keys, stride, bad)}: lengths say {int(lengths[bad])} but "
                f"offsets say {int(derived[bad])}; pass only one of them, or make them agree"
            )
    assert lengths is not None
    length_per_key = validate_lengths(lengths, num_ids, keys, stride, from_offsets)
    return lengths, offsets, stride, length_per_key


def resolve_stride(num_bags: int, num_keys: int, stride: int | None, field: str) -> int:
    """Checks a given stride against the bag count, or infers it as bags // keys."""
    if stride is not None:
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise ValueError(f"stride must be a non-negative int, got {stride!r}")
        if num_bags != num_keys * stride:
            raise ValueError(
                f"{field} covers {num_bags} bags but {num_keys} keys x stride {stride} "
                f"need {num_keys * stride}"
            )
        return stride
    if num_keys == 0:
        if num_bags != 0:
            raise ValueError(f"{field} covers {num_bags} bags but there are no keys")
        return 0
    if num_bags % num_keys != 0:
        raise ValueError(
            f"{field} covers {num_bags} bags, not a multiple of the {num_keys} keys; give one "
            "entry per (feature, bag), key-major, or pass stride"
        )
    return num_bags // num_keys


def check_values(values: torch.Tensor) -> torch.Tensor:
    """Checks the 1-D id tensor and returns it as int64."""
    return as_index_tensor(values, "values")
