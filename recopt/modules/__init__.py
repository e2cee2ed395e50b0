"""Embedding-bag modules: the plain torch collection and its fused-optimizer twin."""

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules.config import EmbeddingBagConfig, validate_tables
from recopt.modules.embedding_bag import EmbeddingBagCollection
from recopt.modules.fused import EmbeddingFusedOptimizer, FusedEmbeddingBagCollection
from recopt.modules.inputs import InvalidIdError, NonFiniteWeightError

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingFusedOptimizer",
    "FusedEmbeddingBagCollection",
    "FusedOptimizerConfig",
    "InvalidIdError",
    "NonFiniteWeightError",
    "PoolingType",
    "validate_tables",
]
