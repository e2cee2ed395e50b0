"""Validation of the jagged layout, shared by JaggedTensor, KeyedJaggedTensor, KeyedTensor.

Two tiers: ``check_*`` look only at shapes, dtypes and devices (no device sync, run on every
construction); ``validate_lengths`` reads the numbers (one reduction and one sync), and only
on failure searches for the feature and bag at fault, so that the message can name them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class IndexDtypeError(ValueError, AssertionError):
    """Lengths or offsets that are not integers.

    A ``ValueError`` like every recopt input error; also an ``AssertionError``, the type
    TorchRec raises here, so TorchRec code that catches it keeps working.
    """


def is_integer(tensor: torch.Tensor) -> bool:
    """True for integer dtypes (not bool, floating or complex)."""
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def as_index_tensor(tensor: torch.Tensor, field: str) -> torch.Tensor:
    """Checks a 1-D integer tensor (lengths, offsets) and returns it as int64."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{field} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() == 0:  # nothing to misread: any dtype or shape of "no entries" will do
        return tensor.reshape(0).long()
    if tensor.dim() != 1:
        raise ValueError(f"{field} must be 1-D, got shape {list(tensor.shape)}; flatten it")
    if not is_integer(tensor):
        raise IndexDtypeError(
            f"{field} must have an integer dtype, got {tensor.dtype}; use .long()"
        )
    return tensor if tensor.dtype == torch.int64 else tensor.long()


def check_values(values: torch.Tensor) -> torch.Tensor:
    """Checks values (ids, floats, or rows of a 2-D tensor); integer ids become int64.

    Ids are checked against a table only where a module looks them up.
    """
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension (one entry per row), got 0-D")
    if is_integer(values) and values.dtype != torch.int64:
        return values.long()
    return values


def check_weights(weights: torch.Tensor | None, values: torch.Tensor) -> None:
    """Checks that optional weights are numeric, one per entry, on the values' device."""
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if weights.dtype == torch.bool or weights.is_complex():
        raise ValueError(f"weights must be real numbers, got {weights.dtype}; use .float()")
    if weights.dim() == 0 or weights.shape[0] != values.shape[0]:
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


def describe_bag(keys: Sequence[str] | None, stride_per_key: Sequence[int], index: int) -> str:
    """Names a (feature, bag) for an error message from its flat index into lengths."""
    if keys is None:
        return f"bag {index}"
    for key, stride in zip(keys, stride_per_key, strict=True):
        if index < stride:
            return f"feature {key!r}, bag {index}"
        index -= stride
    return f"bag {index}"


def exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Returns offsets [N+1] from lengths [N]: 0, then the running sums."""
    offsets = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def check_layout_shapes(
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks dtypes, shapes and devices of lengths/offsets (no sync); returns int64 lengths.

    Lengths missing are derived from offsets on the device (no sync).
    """
    if lengths is None and offsets is None:
        if values.shape[0] == 0:  # no entries and no bags: an empty batch
            return values.new_zeros(0, dtype=torch.int64), None
        raise ValueError("pass lengths or offsets (one count per bag); neither was given")
    if lengths is not None:
        lengths = as_index_tensor(lengths, "lengths")
    if offsets is not None:
        offsets = as_index_tensor(offsets, "offsets")
        if offsets.numel() == 0:  # TorchRec's spelling of "no bags"; [0] in recopt's
            offsets = offsets.new_zeros(1)
        if lengths is not None and offsets.numel() != lengths.numel() + 1:
            raise ValueError(
                f"offsets has {offsets.numel()} entries but lengths has {lengths.numel()}; "
                "offsets needs one more entry than lengths"
            )
    for name, tensor in (("lengths", lengths), ("offsets", offsets)):
        if tensor is not None and tensor.device != values.device:
            raise ValueError(f"{name} is on {tensor.device} but values on {values.device}")
    if lengths is None:
        assert offsets is not None
        lengths = offsets[1:] - offsets[:-1]
    return lengths, offsets


def check_offsets(
    offsets: torch.Tensor | None,
    lengths: torch.Tensor,
    num_ids: int,
    keys: Sequence[str] | None,
    stride_per_key: Sequence[int],
) -> None:
    """Checks that offsets start at 0, end at ``num_ids`` and agree with lengths (one sync)."""
    if offsets is None:
        return
    first, last = torch.stack([offsets[0], offsets[-1]]).tolist()
    if first != 0:
        raise ValueError(f"offsets start at {first} but must start at 0")
    if last != num_ids:
        raise ValueError(
            f"offsets end at {last} but values hold {num_ids} ids; "
            "the last offset must equal len(values)"
        )
    derived = offsets[1:] - offsets[:-1]
    if not torch.equal(derived, lengths):
        bad = int((derived != lengths).nonzero()[0, 0])
        raise ValueError(
            f"{describe_bag(keys, stride_per_key, bad)}: lengths say {int(lengths[bad])} but "
            f"offsets say {int(derived[bad])}; pass only one of them, or make them agree"
        )


def sum_per_key(lengths: torch.Tensor, stride_per_key: Sequence[int]) -> torch.Tensor:
    """Returns the ids of each key [F] (on lengths' device, no sync)."""
    if all(s == stride_per_key[0] for s in stride_per_key):
        return lengths.view(len(stride_per_key), stride_per_key[0]).sum(dim=1)
    sizes = torch.tensor(list(stride_per_key), device=lengths.device)
    owner = torch.repeat_interleave(
        torch.arange(len(stride_per_key), device=lengths.device), sizes, output_size=len(lengths)
    )
    return lengths.new_zeros(len(stride_per_key)).index_add_(0, owner, lengths)


def validate_lengths(
    lengths: torch.Tensor,
    num_ids: int,
    keys: Sequence[str] | None,
    stride_per_key: Sequence[int],
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
    per_key = sum_per_key(lengths, stride_per_key)
    lowest = lengths.min().view(1) if lengths.numel() else per_key.new_zeros(1)
    stats = torch.cat([per_key, lowest]).tolist()
    length_per_key, lowest_length = stats[:-1], stats[-1]
    if lowest_length < 0:
        bad = int((lengths < 0).nonzero()[0, 0])
        where, length = describe_bag(keys, stride_per_key, bad), int(lengths[bad])
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


def resolve_variable_strides(
    stride_per_key_per_rank: Sequence[Sequence[int]] | torch.Tensor,
    keys: Sequence[str],
    num_bags: int,
) -> list[list[int]]:
    """Checks per-key, per-rank batch sizes against the keys and the bag count."""
    if isinstance(stride_per_key_per_rank, torch.Tensor):
        stride_per_key_per_rank = stride_per_key_per_rank.tolist()
    table = [list(per_rank) for per_rank in stride_per_key_per_rank]
    if len(table) != len(keys):
        raise ValueError(
            f"stride_per_key_per_rank has {len(table)} rows but there are {len(keys)} keys; "
            "give one list of per-rank batch sizes per key"
        )
    for key, per_rank in zip(keys, table, strict=True):
        for size in per_rank:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"key {key!r}: batch size {size!r} must be a non-negative int")
    total = sum(sum(per_rank) for per_rank in table)
    if total != num_bags:
        raise ValueError(
            f"stride_per_key_per_rank adds up to {total} bags but lengths cover {num_bags}"
        )
    return table
