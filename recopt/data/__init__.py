"""Data sources for recommendation training: a synthetic click log and the Criteo TSV reader."""

from recopt.data.batch import Batch, BatchIterator
from recopt.data.criteo import CriteoClickLog, hash_categorical, raw_categorical
from recopt.data.synthetic import SyntheticClickLog, SyntheticConfig

__all__ = [
    "Batch",
    "BatchIterator",
    "CriteoClickLog",
    "SyntheticClickLog",
    "SyntheticConfig",
    "hash_categorical",
    "raw_categorical",
]
