"""The read side of a KeyedJaggedTensor: its parts, batch sizes and per-key counts.

`KJTLayout` owns the attributes every KJT holds (set once by `_init`) and the accessors that
read them, including the per-key counts that need the one device sync, computed lazily and
cached. `KeyedJaggedTensor` (keyed_jagged.py) adds construction and the operations that build
new KJTs; the layout itself is described there and in docs/design.md.
"""

from __future__ import annotations

from typing import Self

import torch

from recopt.sparse._checks import check_offsets, exclusive_cumsum, validate_lengths

InverseIndices = tuple[list[str], torch.Tensor]


class KJTLayout:
    """A KeyedJaggedTensor's parts and what follows from them (see `KeyedJaggedTensor`)."""

    _keys: list[str]
    _values: torch.Tensor
    _weights: torch.Tensor | None
    _lengths: torch.Tensor
    _lengths_given: bool
    _offsets: torch.Tensor | None
    _stride_per_key: list[int]
    _stride_per_key_per_rank: list[list[int]] | None
    _inverse_indices: InverseIndices | None
    _stride: int | None
    _length_per_key: list[int] | None
    _offset_per_key: list[int] | None
    _index_per_key: dict[str, int] | None
    _bag_offset_per_key: list[int]

    def _init(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride_per_key: list[int],
        length_per_key: list[int] | None,
        offsets: torch.Tensor | None,
        per_rank: list[list[int]] | None,
        stride: int | None,
    ) -> None:
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._lengths_given = True  # False: built from offsets alone (see lengths_or_none)
        self._offsets = offsets
        self._stride_per_key = stride_per_key
        self._stride_per_key_per_rank = per_rank
        self._inverse_indices = None
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = None
        self._index_per_key = None
        self._bag_offset_per_key = [0]
        for count in stride_per_key:
            self._bag_offset_per_key.append(self._bag_offset_per_key[-1] + count)

    def sync(self) -> Self:
        """Computes (and so checks) ``length_per_key`` now; returns self."""
        if self._values.device.type != "meta":
            self.length_per_key()
        return self

    def unsync(self) -> Self:
        """Forgets the cached per-key counts (they are recomputed on demand); returns self."""
        if self._values.device.type != "cpu":
            self._length_per_key = self._offset_per_key = None
        return self

    def keys(self) -> list[str]:
        """Returns the feature names, in layout order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """Returns the entries, key-major (ids are int64)."""
        return self._values

    def weights(self) -> torch.Tensor:
        """Returns the per-entry weights.

        Raises:
            ValueError: if this KJT has no weights.
        """
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        """Returns the per-entry weights, or None when unweighted."""
        return self._weights

    def lengths(self) -> torch.Tensor:
        """Returns the int64 lengths, one per (feature, bag), key-major."""
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        """Returns the lengths, or None for a KJT built from offsets alone (as TorchRec;
        `lengths()` derives them)."""
        return self._lengths if self._lengths_given else None

    def offsets(self) -> torch.Tensor:
        """Returns the int64 offsets, the exclusive cumsum of lengths."""
        if self._offsets is None:
            self._offsets = exclusive_cumsum(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        """Returns the offsets if given or already computed, else None."""
        return self._offsets

    def stride(self) -> int:
        """Returns B, the batch size; with a variable batch, the largest feature's (or the
        width of ``inverse_indices`` when given)."""
        if self._stride is not None:
            return self._stride
        if self._inverse_indices is not None and self._inverse_indices[1].numel() > 0:
            return int(self._inverse_indices[1].shape[-1])
        return max(self._stride_per_key, default=0)

    def stride_per_key(self) -> list[int]:
        """Returns the number of bags of each feature."""
        return list(self._stride_per_key)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Returns each feature's batch size per rank ([] without a variable batch)."""
        rows = self._stride_per_key_per_rank
        return [] if rows is None else [list(row) for row in rows]

    def variable_stride_per_key(self) -> bool:
        """True when built with ``stride_per_key_per_rank`` (a batch size per feature)."""
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> InverseIndices:
        """Returns ``(keys, [F, B] tensor)`` given at construction.

        Raises:
            ValueError: if none were given.
        """
        if self._inverse_indices is None:
            raise ValueError("this KeyedJaggedTensor has no inverse_indices; pass them to build")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> InverseIndices | None:
        """Returns the inverse indices, or None."""
        return self._inverse_indices

    def device(self) -> torch.device:
        """Returns the device of the values."""
        return self._values.device

    def length_per_key(self) -> list[int]:
        """Returns the entries of each feature (one sync off the CPU, then cached).

        On the meta device, where counts cannot be read, a placeholder: the entries
        split evenly across the keys.

        Raises:
            ValueError: if lengths are negative or do not add up to ``len(values)``.
        """
        if self._length_per_key is None and self._values.device.type == "meta":
            # Counts cannot be read on meta: a placeholder that splits the entries evenly
            # (the first key takes the remainder), so shape-only code can run.
            share, extra = divmod(self._values.shape[0], max(len(self._keys), 1))
            return [share + (extra if i == 0 else 0) for i in range(len(self._keys))]
        if self._length_per_key is None:
            num_ids = self._values.shape[0]
            check_offsets(self._offsets, self._lengths, num_ids, self._keys, self._stride_per_key)
            self._length_per_key = validate_lengths(
                self._lengths, num_ids, self._keys, self._stride_per_key, self._offsets is not None
            )
        return list(self._length_per_key)

    def length_per_key_or_none(self) -> list[int] | None:
        """Returns the entries of each feature if already known, else None (no sync)."""
        return None if self._length_per_key is None else list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Returns F+1 entries: feature ``f``'s entries are ``values()[opk[f]:opk[f+1]]``."""
        if self._offset_per_key is None:
            offsets = [0]
            for count in self.length_per_key():
                offsets.append(offsets[-1] + count)
            self._offset_per_key = offsets
        return list(self._offset_per_key)

    def offset_per_key_or_none(self) -> list[int] | None:
        """Returns the offset per key if already known, else None (no sync)."""
        return None if self._offset_per_key is None else list(self._offset_per_key)

    def lengths_offset_per_key(self) -> list[int]:
        """Returns F+1 entries: feature ``f``'s lengths are ``lengths()[lopk[f]:lopk[f+1]]``."""
        return list(self._bag_offset_per_key)

    def index_per_key(self) -> dict[str, int]:
        """Returns feature name -> its position in ``keys()``."""
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return dict(self._index_per_key)

    def __len__(self) -> int:
        return len(self._keys)

    def _key_index(self, key: str) -> int:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        if key not in self._index_per_key:
            raise KeyError(f"feature {key!r} is not in this KeyedJaggedTensor (keys {self._keys})")
        return self._index_per_key[key]

    def _bags(self, index: int) -> slice:
        return slice(self._bag_offset_per_key[index], self._bag_offset_per_key[index + 1])
