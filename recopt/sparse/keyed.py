"""KeyedTensor: pooled embeddings of several features side by side in one [B, sum(D)] tensor.

An EmbeddingBagCollection returns one; ``regroup`` reassembles the features of several
KeyedTensors into the groups a model's towers consume.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recopt.sparse._checks import check_keys


class KeyedTensor:
    """Several features' dense values concatenated along ``key_dim``.

    Example: keys ``["a", "b"]``, length_per_key ``[2, 3]`` and values of shape ``[B, 5]``
    mean ``kt["a"]`` is ``values[:, 0:2]`` and ``kt["b"]`` is ``values[:, 2:5]``.

    Args:
        keys: the unique feature names, in the order of their columns.
        length_per_key: each feature's width along ``key_dim`` (its embedding dim).
        values: the tensor; its size along ``key_dim`` is ``sum(length_per_key)``.
        key_dim: the dimension the features are concatenated along (1 for [B, D]).

    Raises:
        ValueError: if keys repeat, the widths do not match the keys or the values, or
            ``key_dim`` is not a dimension of values.
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
    ) -> None:
        keys = check_keys(keys)
        length_per_key = list(length_per_key)
        if not isinstance(values, torch.Tensor):
            raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if keys and not 0 <= key_dim < values.dim():
            raise ValueError(
                f"key_dim {key_dim} is not a dimension of values with shape {list(values.shape)}"
            )
        if len(length_per_key) != len(keys):
            raise ValueError(
                f"length_per_key has {len(length_per_key)} entries but there are {len(keys)} "
                "keys; give one width per key"
            )
        for key, width in zip(keys, length_per_key, strict=True):
            if isinstance(width, bool) or not isinstance(width, int) or width < 0:
                raise ValueError(f"key {key!r}: width {width!r} must be a non-negative int")
        if keys and sum(length_per_key) != values.shape[key_dim]:
            raise ValueError(
                f"length_per_key sums to {sum(length_per_key)} but values has "
                f"{values.shape[key_dim]} columns along key_dim {key_dim} "
                f"(shape {list(values.shape)})"
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = [0]
        for width in length_per_key:
            self._offset_per_key.append(self._offset_per_key[-1] + width)
        self._index_per_key = {key: i for i, key in enumerate(keys)}

    @classmethod
    def from_tensor_list(
        cls,
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        key_dim: int = 1,
        cat_dim: int | None = None,
    ) -> KeyedTensor:
        """Concatenates one tensor per key along ``key_dim``.

        Args:
            keys: the feature names, one per tensor.
            tensors: e.g. ``[B, D_key]`` each; all sizes but ``key_dim`` must agree.
            key_dim: the dimension the keys' widths are read from.
            cat_dim: the dimension to concatenate along; default ``key_dim`` (the
                result must hold the keys side by side along key_dim).

        Returns:
            The KeyedTensor.

        Raises:
            ValueError: if the counts of keys and tensors differ, or there are none.
        """
        if len(keys) != len(tensors):
            raise ValueError(f"from_tensor_list: {len(keys)} keys but {len(tensors)} tensors")
        if not tensors:
            raise ValueError("from_tensor_list needs at least one tensor to know the shape")
        widths = [t.shape[key_dim] for t in tensors]
        dim = key_dim if cat_dim is None else cat_dim
        return cls(keys, widths, torch.cat(list(tensors), dim=dim), key_dim=key_dim)

    def keys(self) -> list[str]:
        """Returns the feature names, in column order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """Returns the whole tensor."""
        return self._values

    def key_dim(self) -> int:
        """Returns the dimension the features are concatenated along."""
        return self._key_dim

    def device(self) -> torch.device:
        """Returns the device of the values."""
        return self._values.device

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks the values as used by ``stream`` (see ``torch.Tensor.record_stream``)."""
        self._values.record_stream(stream)

    def length_per_key(self) -> list[int]:
        """Returns each feature's width along ``key_dim``."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Returns F+1 entries: feature ``f`` spans ``[opk[f], opk[f+1])`` along key_dim."""
        return list(self._offset_per_key)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        """Returns feature ``key``'s columns, a view (``[B, D_key]`` for key_dim 1).

        Raises:
            KeyError: if the feature is not among the keys.
        """
        if key not in self._index_per_key:
            raise KeyError(f"feature {key!r} is not in this KeyedTensor (keys {self._keys})")
        index = self._index_per_key[key]
        return self._values.narrow(
            self._key_dim, self._offset_per_key[index], self._length_per_key[index]
        )

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Returns feature name -> its view, in key order."""
        return {key: self[key] for key in self._keys}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        """Returns a copy on ``device`` (shares the tensor when already there)."""
        values = self._values.to(device, non_blocking=non_blocking)
        return KeyedTensor(self._keys, self._length_per_key, values, self._key_dim)

    def __str__(self) -> str:
        """TorchRec's readable form: each key's slice as nested lists."""
        if not self._keys:
            return "KeyedTensor()\n"
        parts = [f'    "{key}": {self[key].tolist()}' for key in self._keys]
        return "KeyedTensor({\n" + ",\n".join(parts) + "\n})\n"

    def __repr__(self) -> str:
        widths = dict(zip(self._keys, self._length_per_key, strict=True))
        return f"KeyedTensor(shape={list(self._values.shape)}, key_dim={self._key_dim}, {widths})"

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[torch.Tensor]:
        """Concatenates each group's features, in the group's order, along key_dim.

        Each key is taken from whichever input holds it. Runs of keys that sit next to each
        other in one input are cut as one slice, so a group that keeps an input's order
        costs one copy. Differentiable: gradients flow back into every input.

        Args:
            keyed_tensors: the inputs; together they hold each key once, and they share
                key_dim and every other dimension.
            groups: lists of keys; a key may appear in several groups.

        Returns:
            One tensor per group (``[B, sum of its widths]`` for key_dim 1).

        Raises:
            ValueError: if a key is in no input or in two, or the inputs' key_dims differ.
        """
        owner: dict[str, int] = {}
        for i, kt in enumerate(keyed_tensors):
            if kt.key_dim() != keyed_tensors[0].key_dim():
                raise ValueError(
                    f"regroup: input {i} has key_dim {kt.key_dim()} but input 0 has "
                    f"{keyed_tensors[0].key_dim()}"
                )
            shape, first_shape = list(kt.values().shape), list(keyed_tensors[0].values().shape)
            shape[kt.key_dim()] = first_shape[kt.key_dim()] = -1
            if shape != first_shape:
                raise ValueError(
                    f"regroup: input {i} has shape {list(kt.values().shape)} but input 0 has "
                    f"{list(keyed_tensors[0].values().shape)}; only key_dim may differ"
                )
            for key in kt.keys():
                if key in owner:
                    raise ValueError(
                        f"regroup: key {key!r} is in input {owner[key]} and input {i}; "
                        "each key must come from exactly one keyed tensor"
                    )
                owner[key] = i
        for group in groups:
            for key in group:
                if key not in owner:
                    raise ValueError(
                        f"regroup: key {key!r} is in no input (inputs hold {sorted(owner)})"
                    )
        return [_gather_group(keyed_tensors, owner, group) for group in groups]

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor],
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
    ) -> dict[str, torch.Tensor]:
        """``regroup``, with each group's tensor named by the matching entry of ``keys``.

        Raises:
            ValueError: if ``keys`` and ``groups`` differ in length, or as ``regroup``.
        """
        if len(keys) != len(groups):
            raise ValueError(
                f"regroup_as_dict: {len(keys)} names for {len(groups)} groups; give one per group"
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))


def _gather_group(
    keyed_tensors: Sequence[KeyedTensor], owner: dict[str, int], group: Sequence[str]
) -> torch.Tensor:
    """Cuts a group's keys as maximal runs of adjacent columns, then concatenates them."""
    if not keyed_tensors:
        return torch.empty(0, 0)
    key_dim = keyed_tensors[0].key_dim()
    runs: list[tuple[int, int, int]] = []  # (input, first column, end column)
    for key in group:
        source = keyed_tensors[owner[key]]
        index = source._index_per_key[key]
        begin, end = source._offset_per_key[index], source._offset_per_key[index + 1]
        if runs and runs[-1][0] == owner[key] and runs[-1][2] == begin:
            runs[-1] = (owner[key], runs[-1][1], end)
        else:
            runs.append((owner[key], begin, end))
    if not runs:
        return keyed_tensors[0].values().narrow(key_dim, 0, 0).clone()
    pieces = [keyed_tensors[i].values().narrow(key_dim, b, e - b) for i, b, e in runs]
    return torch.cat(pieces, dim=key_dim)


regroup = KeyedTensor.regroup
