"""Sparse inputs and pooled outputs: JaggedTensor, KeyedJaggedTensor, KeyedTensor."""

from recopt.sparse.jagged import JaggedTensor
from recopt.sparse.keyed import KeyedTensor, regroup
from recopt.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "regroup"]
