"""``torchrec.sparse``: the sparse types (recopt's)."""

from recopt.torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
