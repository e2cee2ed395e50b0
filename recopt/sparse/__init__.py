"""Sparse inputs and pooled outputs: JaggedTensor, KeyedJaggedTensor, KeyedTensor."""

from recopt.sparse import _pytree
from recopt.sparse._checks import IndexDtypeError
from recopt.sparse.jagged import JaggedTensor
from recopt.sparse.keyed import KeyedTensor, regroup
from recopt.sparse.keyed_jagged import KeyedJaggedTensor

_pytree.register()

__all__ = ["IndexDtypeError", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "regroup"]
