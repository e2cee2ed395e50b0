"""Jagged inputs: JaggedTensor (one feature) and KeyedJaggedTensor (F features, key-major).

Layout (docs/design.md): ``lengths`` [F*B] counts the ids of each (feature, bag), all of
feature 0's bags first; ``values`` holds the ids in the same order, ``weights`` one float per
id, ``offsets`` [F*B+1] is the exclusive cumsum of ``lengths``. Because the layout is
key-major, each feature's ids are one contiguous slice, so per-key work is slicing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from recopt.sparse._checks import (
    check_keys,
    check_values,
    check_weights,
    exclusive_cumsum,
    resolve_lengths,
    resolve_stride,
)

_REPR_MAX_IDS = 64  # __repr__ prints ids up to this many, a summary beyond


class JaggedTensor:
    """One feature's batch of variable-length bags: ``values`` split by ``lengths``.

    Example: ``JaggedTensor(torch.tensor([7, 8, 9]), lengths=torch.tensor([2, 0, 1]))``
    holds three bags, ``[7, 8]``, ``[]`` and ``[9]``; its offsets are ``[0, 2, 2, 3]``.

    Args:
        values: 1-D tensor of all bags' entries, bag after bag. Integer values (ids) are
            stored as int64; other dtypes are kept.
        lengths: 1-D integer tensor, the number of entries of each bag.
        offsets: 1-D integer tensor with one more entry than there are bags; bag ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``. Give lengths, offsets or both.
        weights: optional floating tensor with one weight per entry of ``values``.

    Raises:
        ValueError: if neither lengths nor offsets is given, a length is negative, offsets
            do not start at 0, decrease or do not end at ``len(values)``, or weights do not
            match values.
    """

    def __init__(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() != 1:
            shape = list(values.shape) if isinstance(values, torch.Tensor) else type(values)
            raise ValueError(f"values must be a 1-D tensor, got {shape}")
        if not (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool):
            values = check_values(values)
        check_weights(weights, values)
        lengths, offsets, _, _ = resolve_lengths(values, lengths, offsets, None, None)
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
            if not isinstance(bag, torch.Tensor) or bag.dim() != 1:
                raise ValueError(f"from_dense: bag {i} must be a 1-D tensor")
        if weights is not None:
            if len(weights) != len(values):
                raise ValueError(
                    f"from_dense: {len(weights)} weight tensors for {len(values)} bags; "
                    "give one per bag"
                )
            for i, (bag, bag_weights) in enumerate(zip(values, weights, strict=True)):
                if bag_weights.shape != bag.shape:
                    raise ValueError(
                        f"from_dense: bag {i} has {bag.numel()} entries but "
                        f"{bag_weights.numel()} weights"
                    )
        lengths = torch.tensor([bag.numel() for bag in values], dtype=torch.int64)
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

    def offsets(self) -> torch.Tensor:
        """Returns the int64 exclusive cumsum of lengths, one entry more than bags."""
        if self._offsets is None:
            self._offsets = exclusive_cumsum(self._lengths)
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

    def __repr__(self) -> str:
        if self._values.numel() > _REPR_MAX_IDS:
            num_bags, num_values = self._lengths.numel(), self._values.numel()
            return f"JaggedTensor(num_bags={num_bags}, num_values={num_values})"
        return f"JaggedTensor({_bags_text(self)})"


class KeyedJaggedTensor:
    """F features' jagged ids for one batch of B samples, in the key-major layout.

    Example: keys ``["a", "b"]``, stride 2, lengths ``[2, 0, 1, 1]`` and values
    ``[10, 11, 20, 21]`` mean sample 0 has ids ``a: [10, 11], b: [20]`` and sample 1 has
    ``a: [], b: [21]``. ``length_per_key()`` is ``[2, 2]``, ``offset_per_key()`` ``[0, 2, 4]``.

    Construction checks the layout with about one reduction and one device sync; the
    results of ``split``, ``permute``, ``concat`` and ``[]`` are valid by construction and
    cost no sync.

    Args:
        keys: the F unique feature names.
        values: 1-D integer ids of every (feature, bag), key-major; stored as int64.
        weights: optional floating tensor, one weight per id.
        lengths: 1-D integer tensor [F*B], the ids per (feature, bag).
        offsets: 1-D integer tensor [F*B+1], the exclusive cumsum of lengths. Give lengths,
            offsets or both (then they must agree).
        stride: B, the batch size; inferred as ``len(lengths) // F`` when None.

    Raises:
        ValueError: on a malformed layout; the message names the feature, the bag and the
            numbers at fault.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> None:
        keys = check_keys(keys)
        values = check_values(values)
        check_weights(weights, values)
        lengths, offsets, stride, length_per_key = resolve_lengths(
            values, lengths, offsets, keys, stride
        )
        self._init(keys, values, weights, lengths, stride, length_per_key, offsets)

    def _init(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride: int,
        length_per_key: list[int],
        offsets: torch.Tensor | None,
    ) -> None:
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = [0]
        for count in length_per_key:
            self._offset_per_key.append(self._offset_per_key[-1] + count)
        self._index_per_key: dict[str, int] | None = None

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride: int,
        length_per_key: list[int],
        offsets: torch.Tensor | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from parts that are already valid (the results of our own operations)."""
        kjt = cls.__new__(cls)
        kjt._init(keys, values, weights, lengths, stride, length_per_key, offsets)
        return kjt

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from lengths; see the class docstring for the arguments and errors."""
        return cls(keys, values, weights=weights, lengths=lengths, stride=stride)

    @classmethod
    def from_offsets_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from offsets; see the class docstring for the arguments and errors."""
        return cls(keys, values, weights=weights, offsets=offsets, stride=stride)

    @classmethod
    def from_id_lists(
        cls,
        ids: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from Python lists: ``ids[feature][sample]`` is that bag's ids.

        Args:
            ids: feature name -> one list of ids per sample; every feature has the same
                number of samples (the stride). Dict order gives the key order.
            weights: optional, the same structure with one float per id (float32).

        Returns:
            The KeyedJaggedTensor on CPU.

        Raises:
            ValueError: if batch sizes differ between features, or weights do not match ids.
        """
        keys = check_keys(list(ids))
        stride = len(ids[keys[0]]) if keys else 0
        for key in keys:
            if len(ids[key]) != stride:
                raise ValueError(
                    f"feature {key!r} has {len(ids[key])} samples but feature {keys[0]!r} has "
                    f"{stride}; every feature needs one bag per sample"
                )
        lengths = [len(bag) for key in keys for bag in ids[key]]
        values = torch.tensor(
            [i for key in keys for bag in ids[key] for i in bag], dtype=torch.int64
        )
        flat_weights = None if weights is None else _flat_weights(ids, weights, keys, stride)
        lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
        return cls(keys, values, weights=flat_weights, lengths=lengths_tensor, stride=stride)

    @classmethod
    def from_jt_dict(cls, jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Builds from one JaggedTensor per feature (dict order gives the key order).

        Raises:
            ValueError: if the features' batch sizes differ, or some are weighted and some not.
        """
        keys = check_keys(list(jt_dict))
        if not keys:
            return cls.empty()
        first = keys[0]
        stride = jt_dict[first].lengths().numel()
        weighted = jt_dict[first].weights_or_none() is not None
        for key in keys:
            jt = jt_dict[key]
            if jt.lengths().numel() != stride:
                raise ValueError(
                    f"feature {key!r} has {jt.lengths().numel()} bags but feature {first!r} has "
                    f"{stride}; every feature needs one bag per sample"
                )
            if (jt.weights_or_none() is not None) != weighted:
                raise ValueError(
                    f"feature {first!r} is {'' if weighted else 'un'}weighted but {key!r} is not; "
                    "give weights to all features or to none"
                )
        jts = [jt_dict[key] for key in keys]
        values = torch.cat([jt.values() for jt in jts])
        lengths = torch.cat([jt.lengths() for jt in jts])
        weights = torch.cat([jt.weights() for jt in jts]) if weighted else None
        return cls(keys, values, weights=weights, lengths=lengths, stride=stride)

    @classmethod
    def empty(
        cls,
        keys: Sequence[str] | None = None,
        stride: int = 0,
        device: torch.device | str | None = None,
        weighted: bool = False,
    ) -> KeyedJaggedTensor:
        """Returns a KJT with no ids: every bag of every key (default none) is empty."""
        keys = check_keys(keys or [])
        resolve_stride(0, 0, stride, "empty")
        values = torch.empty(0, dtype=torch.int64, device=device)
        weights = torch.empty(0, dtype=torch.float32, device=device) if weighted else None
        lengths = torch.zeros(len(keys) * stride, dtype=torch.int64, device=device)
        return cls._trusted(keys, values, weights, lengths, stride, [0] * len(keys))

    @staticmethod
    def concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Joins KJTs of the same batch; keys follow in order and must be disjoint.

        Raises:
            ValueError: if the list is empty, strides differ, a key repeats, or some inputs
                are weighted and some not.
        """
        if not kjts:
            raise ValueError("concat needs at least one KeyedJaggedTensor, got none")
        first = kjts[0]
        owner: dict[str, int] = {}
        for i, kjt in enumerate(kjts):
            if kjt.stride() != first.stride():
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
        return KeyedJaggedTensor._trusted(
            [key for kjt in kjts for key in kjt.keys()],
            torch.cat([kjt.values() for kjt in kjts]),
            weights,
            torch.cat([kjt.lengths() for kjt in kjts]),
            first.stride(),
            [count for kjt in kjts for count in kjt.length_per_key()],
        )

    def keys(self) -> list[str]:
        """Returns the feature names, in layout order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """Returns the int64 ids [sum of lengths], key-major."""
        return self._values

    def weights(self) -> torch.Tensor:
        """Returns the per-id weights.

        Raises:
            ValueError: if this KJT has no weights.
        """
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        """Returns the per-id weights, or None when unweighted."""
        return self._weights

    def lengths(self) -> torch.Tensor:
        """Returns the int64 lengths [F*B], key-major."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Returns the int64 offsets [F*B+1], the exclusive cumsum of lengths."""
        if self._offsets is None:
            self._offsets = exclusive_cumsum(self._lengths)
        return self._offsets

    def stride(self) -> int:
        """Returns B, the batch size."""
        return self._stride

    def device(self) -> torch.device:
        """Returns the device of the ids."""
        return self._values.device

    def length_per_key(self) -> list[int]:
        """Returns the number of ids of each feature."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Returns F+1 entries: feature ``f``'s ids are ``values()[opk[f]:opk[f+1]]``."""
        return list(self._offset_per_key)

    def __len__(self) -> int:
        return len(self._keys)

    def _key_index(self, key: str) -> int:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        if key not in self._index_per_key:
            raise KeyError(f"feature {key!r} is not in this KeyedJaggedTensor (keys {self._keys})")
        return self._index_per_key[key]

    def __getitem__(self, key: str) -> JaggedTensor:
        """Returns feature ``key``'s bags as a JaggedTensor of views.

        Raises:
            KeyError: if the feature is not among the keys.
        """
        index = self._key_index(key)
        start, end = self._offset_per_key[index], self._offset_per_key[index + 1]
        bags = slice(index * self._stride, (index + 1) * self._stride)
        weights = None if self._weights is None else self._weights[start:end]
        return JaggedTensor._trusted(self._values[start:end], self._lengths[bags], weights)

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Returns feature name -> its JaggedTensor, in key order."""
        return {key: self[key] for key in self._keys}

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Splits the keys into consecutive groups of the given sizes (0 allowed).

        Every part is made of views of this KJT's tensors: no copy, no sync.

        Raises:
            ValueError: if a size is negative or the sizes do not add up to ``len(self)``.
        """
        segments = list(segments)
        for size in segments:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"split: segment sizes must be non-negative ints, got {size!r}")
        if sum(segments) != len(self._keys):
            raise ValueError(
                f"split: segments {segments} sum to {sum(segments)} but there are "
                f"{len(self._keys)} keys"
            )
        parts, first = [], 0
        for size in segments:
            last = first + size
            start, end = self._offset_per_key[first], self._offset_per_key[last]
            weights = None if self._weights is None else self._weights[start:end]
            parts.append(
                KeyedJaggedTensor._trusted(
                    self._keys[first:last],
                    self._values[start:end],
                    weights,
                    self._lengths[first * self._stride : last * self._stride],
                    self._stride,
                    self._length_per_key[first:last],
                )
            )
            first = last
        return parts

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Returns a KJT whose key ``i`` is this KJT's key ``indices[i]``.

        Indices may repeat a key (it then appears twice) or leave keys out. Costs one
        gather over lengths and one concatenation over the chosen ids; no sync.

        Raises:
            ValueError: if an index is not in ``range(len(self))``.
        """
        indices = list(indices)
        num_keys = len(self._keys)
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_keys:
                raise ValueError(
                    f"permute: index {index!r} is not in range({num_keys}) of the keys"
                )
        order = torch.tensor(indices, dtype=torch.int64, device=self._lengths.device)
        lengths = self._lengths.view(num_keys, self._stride).index_select(0, order).reshape(-1)
        opk = self._offset_per_key

        def gather(t: torch.Tensor) -> torch.Tensor:
            if not indices:
                return t[:0]
            return torch.cat([t[opk[i] : opk[i + 1]] for i in indices])

        return KeyedJaggedTensor._trusted(
            [self._keys[i] for i in indices],
            gather(self._values),
            None if self._weights is None else gather(self._weights),
            lengths,
            self._stride,
            [self._length_per_key[i] for i in indices],
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        """Returns this KJT on ``device`` (sharing the tensors already there)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return KeyedJaggedTensor._trusted(
            list(self._keys),
            move(self._values),
            None if self._weights is None else move(self._weights),
            move(self._lengths),
            self._stride,
            list(self._length_per_key),
            None if self._offsets is None else move(self._offsets),
        )

    def __repr__(self) -> str:
        head = f"KeyedJaggedTensor(stride={self._stride}, weighted={self._weights is not None}"
        if self._values.numel() > _REPR_MAX_IDS:
            counts = dict(zip(self._keys, self._length_per_key, strict=True))
            return f"{head}, ids per key={counts})"
        features = [f"{key!r}: {_bags_text(self[key])}" for key in self._keys]
        return ",\n  ".join([head, *features]) + ")"


def _flat_weights(
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
