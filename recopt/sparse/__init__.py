"""Sparse inputs and pooled outputs: JaggedTensor, KeyedJaggedTensor, KeyedTensor."""

from recopt.sparse.jagged import JaggedTensor, KeyedJaggedTensor
from recopt.sparse.keyed import KeyedTensor, regroup

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "regroup"]
