"""KeyedJaggedTensor: F features' jagged values for one batch, in the key-major layout.

Layout (docs/design.md): ``lengths`` counts the entries of each (feature, bag), all of
feature 0's bags first; ``values`` holds the entries in the same order, ``weights`` one per
entry, ``offsets`` is the exclusive cumsum of ``lengths``. Each feature's entries are one
contiguous slice, so per-key work is slicing. Feature ``f`` has ``stride_per_key()[f]`` bags:
the batch size B for all features, or a per-feature size (variable batch per feature).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from recopt.sparse._checks import (
    check_keys,
    check_layout_shapes,
    check_values,
    check_weights,
    resolve_stride,
    resolve_variable_strides,
)
from recopt.sparse._kjt_build import empty_kjt, empty_like_kjt, kjt_from_id_lists, kjt_from_jt_dict
from recopt.sparse._kjt_helpers import (
    concat_kjts,
    kjt_repr,
    kjt_text,
    map_tensors,
    permute_kjt,
    split_kjt,
)
from recopt.sparse._kjt_layout import InverseIndices, KJTLayout
from recopt.sparse.jagged import JaggedTensor


class KeyedJaggedTensor(KJTLayout):
    """F features' jagged values for one batch, key-major.

    Example: keys ``["a", "b"]``, stride 2, lengths ``[2, 0, 1, 1]`` and values
    ``[10, 11, 20, 21]`` mean sample 0 has ids ``a: [10, 11], b: [20]`` and sample 1 has
    ``a: [], b: [21]``. ``length_per_key()`` is ``[2, 2]``, ``offset_per_key()`` ``[0, 2, 4]``.

    Checks: shapes, dtypes and devices always (no sync). The numbers (lengths >= 0 and
    summing to ``len(values)``, offsets agreeing) are checked at construction when values
    are on the CPU; on an accelerator they are checked when ``length_per_key`` is first
    computed (the one sync that needs anyway), so building a CUDA KJT and passing it to an
    embedding module whose features are in order costs no sync here. The results of
    ``split``, ``permute``, ``concat`` and ``[]`` are valid by construction.

    Args:
        keys: the F unique feature names.
        values: entries of every (feature, bag), key-major, along dim 0: ids (stored as
            int64), floats, or rows of a 2-D tensor.
        weights: optional tensor, one weight per entry.
        lengths: 1-D integer tensor, the entries per (feature, bag).
        offsets: 1-D integer tensor, the exclusive cumsum of lengths (one more entry).
            Give lengths, offsets or both (then they must agree).
        stride: B, the batch size; inferred as ``len(lengths) // F`` when None.
        stride_per_key_per_rank: variable batch per feature: for each key, the batch size
            contributed by each rank; feature ``f`` then has ``sum(row f)`` bags.
        stride_per_key: ignored when stride_per_key_per_rank is given (derived from it).
        length_per_key: optional trusted entries per key (skips the sync that derives it;
            then the sums are not checked).
        inverse_indices: optional ``(keys, [F, B] tensor)`` mapping each sample of the full
            batch to its row in a variable-batch feature (kept for the caller).

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
        stride_per_key_per_rank: Sequence[Sequence[int]] | torch.Tensor | None = None,
        stride_per_key: Sequence[int] | None = None,
        length_per_key: Sequence[int] | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> None:
        keys = check_keys(keys)
        values = check_values(values)
        check_weights(weights, values)
        lengths_given = lengths is not None
        lengths, offsets = check_layout_shapes(values, lengths, offsets)
        per_rank, batch = None, None
        if stride_per_key_per_rank is not None and len(stride_per_key_per_rank) > 0:
            per_rank = resolve_variable_strides(stride_per_key_per_rank, keys, lengths.numel())
            strides = [sum(row) for row in per_rank]
        else:
            batch = resolve_stride(lengths.numel(), len(keys), stride, "lengths")
            strides = [batch] * len(keys)
        lpk = None if length_per_key is None else [int(n) for n in length_per_key]
        batch = batch if per_rank is None else stride
        self._init(keys, values, weights, lengths, strides, lpk, offsets, per_rank, batch)
        self._lengths_given = lengths_given
        self._inverse_indices: InverseIndices | None = inverse_indices
        if values.device.type == "cpu" and lpk is None:
            self.length_per_key()  # validates now: on the CPU it costs no device sync

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride_per_key: list[int],
        length_per_key: list[int] | None,
        offsets: torch.Tensor | None = None,
        per_rank: list[list[int]] | None = None,
        stride: int | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from parts that are already valid (the results of our own operations).

        ``stride`` None means B is derived (from ``inverse_indices`` or the largest feature).
        """
        kjt = cls.__new__(cls)
        spk, lpk = stride_per_key, length_per_key
        kjt._init(keys, values, weights, lengths, spk, lpk, offsets, per_rank, stride)
        kjt._inverse_indices = inverse_indices
        return kjt

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from lengths and computes ``length_per_key`` now (one sync off the CPU)."""
        kjt = cls(
            keys,
            values,
            weights=weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        return kjt.sync()

    @classmethod
    def from_offsets_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: InverseIndices | None = None,
    ) -> KeyedJaggedTensor:
        """Builds from offsets and computes ``length_per_key`` now (one sync off the CPU)."""
        kjt = cls(
            keys,
            values,
            weights=weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        return kjt.sync()

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
        return kjt_from_id_lists(cls, ids, weights)

    @classmethod
    def from_jt_dict(cls, jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Builds from one JaggedTensor per feature (dict order gives the key order).

        Features with different bag counts give a variable-batch KJT (one rank per key).

        Raises:
            ValueError: if some features are weighted and some not.
        """
        return kjt_from_jt_dict(cls, jt_dict)

    @classmethod
    def empty(
        cls,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int64,
        *,
        keys: Sequence[str] = (),
        stride: int = 0,
    ) -> KeyedJaggedTensor:
        """Returns a KJT with no entries: every bag of every key (default none) is empty.

        Lengths are int64 whatever ``lengths_dtype`` asks (recopt's kernels take int64).
        """
        del lengths_dtype
        return empty_kjt(cls, keys, stride, device, values_dtype, weights_dtype, is_weighted)

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Returns a KJT with the keys, batch sizes, dtypes and device of ``kjt`` but no entries."""
        return empty_like_kjt(kjt)

    @staticmethod
    def concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Joins KJTs of the same batch; keys follow in order and must be disjoint.

        Raises:
            ValueError: if the list is empty, strides differ (unless some input has a
                variable batch per feature), a key repeats, or some inputs are weighted
                and some not.
        """
        return concat_kjts(kjts)

    def __getitem__(self, key: str) -> JaggedTensor:
        """Returns feature ``key``'s bags as a JaggedTensor of views.

        Raises:
            KeyError: if the feature is not among the keys.
        """
        index = self._key_index(key)
        opk = self.offset_per_key()
        start, end = opk[index], opk[index + 1]
        weights = None if self._weights is None else self._weights[start:end]
        return JaggedTensor._trusted(
            self._values[start:end], self._lengths[self._bags(index)], weights
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Returns feature name -> its JaggedTensor, in key order."""
        return {key: self[key] for key in self._keys}

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Splits the keys into consecutive groups of the given sizes (0 allowed).

        Every part is made of views of this KJT's tensors: no copy.

        Raises:
            ValueError: if a size is negative or the sizes do not add up to ``len(self)``.
        """
        return split_kjt(self, segments)

    def permute(
        self, indices: Sequence[int], indices_tensor: torch.Tensor | None = None
    ) -> KeyedJaggedTensor:
        """Returns a KJT whose key ``i`` is this KJT's key ``indices[i]``.

        Indices may repeat a key (it then appears twice) or leave keys out. Costs one
        gather over lengths and one concatenation over the chosen entries. A reordering
        of all keys whose counts are not yet known (an accelerator KJT) is done on the
        device without a sync; other cases need ``length_per_key`` (one sync, cached).
        ``indices_tensor`` is accepted for TorchRec compatibility and not needed.

        Raises:
            ValueError: if an index is not in ``range(len(self))``.
        """
        del indices_tensor
        return permute_kjt(self, indices)

    def to(
        self,
        device: torch.device | str,
        non_blocking: bool = False,
        dtype: torch.dtype | None = None,
    ) -> KeyedJaggedTensor:
        """Returns this KJT on ``device`` (sharing tensors already there); ``dtype``, when
        given, converts floating values and weights."""
        moved = map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))
        if dtype is not None:
            if moved._values.is_floating_point():
                moved._values = moved._values.to(dtype)
            if moved._weights is not None:
                moved._weights = moved._weights.to(dtype)
        return moved

    def with_values(self, values: torch.Tensor) -> KeyedJaggedTensor:
        """Returns this KJT with ``values`` in place of its own (as many): keys, lengths,
        weights and the counts already known are kept, so nothing is checked or read back
        from a device again (id-mapped tables put their rows in a batch this way).

        Raises:
            ValueError: ``values`` is not 1-D with ``len(values())`` entries.
        """
        if values.dim() != 1 or values.shape[0] != self._values.shape[0]:
            raise ValueError(
                f"with_values: got values of shape {tuple(values.shape)}, need "
                f"({self._values.shape[0]},) (one per entry of this KeyedJaggedTensor)"
            )
        moved = map_tensors(self, lambda t: t)
        moved._values = values
        return moved

    def pin_memory(self) -> KeyedJaggedTensor:
        """Returns a copy in pinned host memory."""
        return map_tensors(self, lambda t: t.pin_memory())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (values, weights, lengths, offsets, inverse indices, if present)."""
        inverse = None if self._inverse_indices is None else self._inverse_indices[1]
        found = (self._values, self._weights, self._lengths, self._offsets, inverse)
        return [tensor for tensor in found if tensor is not None]

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor as used by ``stream`` (see ``torch.Tensor.record_stream``)."""
        for tensor in self.tensors():
            tensor.record_stream(stream)

    def __str__(self) -> str:
        """TorchRec's readable form: each key's bags (and weights) as nested lists."""
        return kjt_text(self)

    def __repr__(self) -> str:
        return kjt_repr(self)
