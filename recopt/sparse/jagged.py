"""JaggedTensor: one feature's batch of variable-length bags (values split by lengths).

Values may be ids, floats, or rows of a 2-D tensor (``values[i]`` is entry ``i``);
``offsets`` is the exclusive cumsum of ``lengths``. The keyed, many-feature form is
``KeyedJaggedTensor`` (keyed_jagged.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recopt.sparse._checks import (
    check_layout_shapes,
    check_offsets,
    check_values,
    check_weights,
    exclusive_cumsum,
    validate_lengths,
)

_REPR_MAX_IDS = 64  # __repr__ prints ids up to this many, a summary beyond


class JaggedTensor:
    """One feature's batch of variable-length bags: ``values`` split by ``lengths``.

    Example: ``JaggedTensor(torch.tensor([7, 8, 9]), lengths=torch.tensor([2, 0, 1]))``
    holds three bags, ``[7, 8]``, ``[]`` and ``[9]``; its offsets are ``[0, 2, 2, 3]``.

    The layout (lengths non-negative and summing to ``len(values)``, offsets agreeing) is
    checked at construction when values are on the CPU; on an accelerator that check would
    cost a device sync, so it is not made (the embedding modules check ids themselves).

    Args:
        values: tensor of all bags' entries, bag after bag, along dim 0. Integer values
            (ids) are stored as int64; other dtypes (floats, 2-D rows) are kept.
        weights: optional tensor with one weight per entry of ``values``.
        lengths: 1-D integer tensor, the number of entries of each bag (stored as int64).
        offsets: 1-D integer tensor with one more entry than there are bags; bag ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``. Give lengths, offsets or both.

    Raises:
        ValueError: if neither lengths nor offsets is given, a length is negative, offsets
            do not start at 0, decrease or do not end at ``len(values)``, or weights do not
            match values.
    """

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        values = check_values(values)
        check_weights(weights, values)
        lengths, offsets = check_layout_shapes(values, lengths, offsets)
        if values.device.type == "cpu":
            num_bags = [lengths.numel()]
            check_offsets(offsets, lengths, values.shape[0], None, num_bags)
            validate_lengths(lengths, values.shape[0], None, num_bags, offsets is not None)
        self._values = values
        self._lengths = lengths
        self._offsets = offsets
        self._weights = weights

    @classmethod
    def _trusted(
        cls,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        offsets: torch.Tensor | None = None,
    ) -> JaggedTensor:
        """Builds from parts that are already valid (the results of our own operations)."""
        jt = cls.__new__(cls)
        jt._values, jt._lengths, jt._offsets, jt._weights = values, lengths, offsets, weights
        return jt

    @classmethod
    def empty(
        cls,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int64,
    ) -> JaggedTensor:
        """Returns a JaggedTensor with no bags (lengths are stored as int64 whatever asked)."""
        values = torch.empty(0, dtype=values_dtype, device=device)
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return cls._trusted(
            check_values(values), torch.empty(0, dtype=torch.int64, device=device), weights
        )

    @classmethod
    def from_dense_lengths(
        cls,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> JaggedTensor:
        """Builds from a padded ``[B, N, ...]`` tensor, keeping the first ``lengths[b]`` of row b.

        Raises:
            ValueError: if a length is negative or above ``N``, or weights' shape differs.
        """
        if not isinstance(values, torch.Tensor) or values.dim() < 2:
            raise ValueError("from_dense_lengths: values must be a [B, N, ...] tensor")
        lengths = lengths.to(device=values.device, dtype=torch.int64)
        if lengths.shape != values.shape[:1]:
            raise ValueError(
                f"from_dense_lengths: {lengths.numel()} lengths for {values.shape[0]} rows"
            )
        if weights is not None and weights.shape[:2] != values.shape[:2]:
            raise ValueError(
                f"from_dense_lengths: weights have shape {list(weights.shape)} but values "
                f"{list(values.shape)}; the first two dimensions must match"
            )
        if (
            values.device.type == "cpu"
            and lengths.numel()
            and (int(lengths.min()) < 0 or int(lengths.max()) > values.shape[1])
        ):
            raise ValueError(
                f"from_dense_lengths: lengths must lie in [0, {values.shape[1]}], got "
                f"{lengths.tolist()}"
            )
        keep = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1)
        kept_weights = None if weights is None else weights[keep]
        return cls._trusted(values[keep], lengths, kept_weights)

    @classmethod
    def from_dense(
        cls, values: Sequence[torch.Tensor], weights: Sequence[torch.Tensor] | None = None
    ) -> JaggedTensor:
        """Builds a JaggedTensor from one 1-D tensor per bag.

        Args:
            values: the bags; an empty list gives an empty int64 JaggedTensor.
            weights: optional, one floating tensor per bag, each as long as its bag.

        Returns:
            The JaggedTensor of those bags.

        Raises:
            ValueError: if a bag is not 1-D or the weights do not match the bags.
        """
        for i, bag in enumerate(values):
            if not isinstance(bag, torch.Tensor) or bag.shape[1:] != values[0].shape[1:]:
                raise ValueError(
                    f"from_dense: bag {i} must be a {values[0].dim()}-D tensor with rows like "
                    f"bag 0's, got {type(bag).__name__} {list(getattr(bag, 'shape', []))}"
                )
        if weights is not None:
            if len(weights) != len(values):
                raise ValueError(
                    f"from_dense: {len(weights)} weight tensors for {len(values)} bags; "
                    "give one per bag"
                )
            for i, (bag, bag_weights) in enumerate(zip(values, weights, strict=True)):
                if bag_weights.shape[:1] != bag.shape[:1]:
                    raise ValueError(
                        f"from_dense: bag {i} has {bag.numel()} entries but "
                        f"{bag_weights.numel()} weights"
                    )
        lengths = torch.tensor([bag.shape[0] for bag in values], dtype=torch.int64)
        if not values:
            return cls(torch.empty(0, dtype=torch.int64), lengths=lengths)
        lengths = lengths.to(values[0].device)
        joined_weights = torch.cat(list(weights)) if weights is not None else None
        return cls(torch.cat(list(values)), lengths=lengths, weights=joined_weights)

    def values(self) -> torch.Tensor:
        """Returns all bags' entries, bag after bag."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """Returns the int64 number of entries of each bag."""
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        """Returns the lengths (always present: derived from offsets when needed)."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Returns the int64 exclusive cumsum of lengths, one entry more than bags."""
        if self._offsets is None:
            self._offsets = exclusive_cumsum(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        """Returns the offsets if given or already computed, else None."""
        return self._offsets

    def weights(self) -> torch.Tensor:
        """Returns the per-entry weights.

        Raises:
            ValueError: if this JaggedTensor has no weights.
        """
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        """Returns the per-entry weights, or None when unweighted."""
        return self._weights

    def device(self) -> torch.device:
        """Returns the device of the values."""
        return self._values.device

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """Returns ``[B, N, ...]``: each bag's first N entries, padded with ``padding_value``.

        N is ``desired_length``, or the longest bag when None (one sync to find it).
        """
        return _pad(self._values, self._lengths, desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        """Returns the weights padded like ``to_padded_dense``, or None when unweighted."""
        if self._weights is None:
            return None
        return _pad(self._weights, self._lengths, desired_length, padding_value)

    def to_dense(self) -> list[torch.Tensor]:
        """Returns one tensor per bag (views of values)."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        """Returns one weight tensor per bag, or None when unweighted."""
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self._lengths.tolist()))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        """Returns this JaggedTensor on ``device`` (sharing the tensors already there)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        values, lengths = move(self._values), move(self._lengths)
        assert values is not None and lengths is not None
        return JaggedTensor._trusted(values, lengths, move(self._weights), move(self._offsets))

    def __str__(self) -> str:
        """TorchRec's readable form: the bags (and weights) as nested lists.

        Raises:
            ValueError: for values of more than 2 dimensions.
        """
        if self._values.dim() > 2:
            raise ValueError(f"str() shows 1-D or 2-D values, got {self._values.dim()}-D")
        values = [bag.tolist() for bag in self.to_dense()]
        weights = self.to_dense_weights()
        if weights is None:
            return f"JaggedTensor({{\n    {values}\n}})\n"
        weight_lists = [bag.tolist() for bag in weights]
        body = f'    "values": {values},\n    "weights": {weight_lists}'
        return f"JaggedTensor({{\n{body}\n}})\n"

    def __repr__(self) -> str:
        if self._values.numel() > _REPR_MAX_IDS:
            num_bags, num_values = self._lengths.numel(), self._values.numel()
            return f"JaggedTensor(num_bags={num_bags}, num_values={num_values})"
        return f"JaggedTensor({_bags_text(self)})"

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor as used by ``stream`` (see ``torch.Tensor.record_stream``)."""
        for tensor in (self._values, self._lengths, self._offsets, self._weights):
            if tensor is not None:
                tensor.record_stream(stream)

    def pin_memory(self) -> JaggedTensor:
        """Returns a copy in pinned host memory."""
        pinned = [
            None if t is None else t.pin_memory()
            for t in (self._values, self._lengths, self._weights, self._offsets)
        ]
        values, lengths = pinned[0], pinned[1]
        assert values is not None and lengths is not None
        return JaggedTensor._trusted(values, lengths, pinned[2], pinned[3])


def _pad(
    values: torch.Tensor, lengths: torch.Tensor, desired_length: int | None, padding: float
) -> torch.Tensor:
    """Scatters bag entries into ``[B, N, ...]``, dropping entries past N."""
    if desired_length is None:
        desired_length = int(lengths.max()) if lengths.numel() else 0
    num_bags = lengths.numel()
    out = values.new_full((num_bags, desired_length, *values.shape[1:]), padding)
    bags = torch.arange(num_bags, device=values.device)
    bag = torch.repeat_interleave(bags, lengths, output_size=values.shape[0])  # no device read
    position = torch.arange(values.shape[0], device=values.device) - exclusive_cumsum(lengths)[bag]
    keep = position < desired_length
    out[bag[keep], position[keep]] = values[keep]
    return out


def _bags_text(jt: JaggedTensor) -> str:
    """Formats bags as nested lists, each id followed by its weight when weighted."""
    bags = [bag.tolist() for bag in jt.to_dense()]
    weights = jt.to_dense_weights()
    if weights is None:
        return str(bags)
    pairs = [
        [f"{i}*{w:.4g}" for i, w in zip(bag, bag_weights.tolist(), strict=True)]
        for bag, bag_weights in zip(bags, weights, strict=True)
    ]
    return str(pairs).replace("'", "")
