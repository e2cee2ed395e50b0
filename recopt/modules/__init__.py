"""Embedding-bag modules: the plain torch collection and its fused-optimizer twin."""

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules.config import EmbeddingBagConfig, validate_tables
from recopt.modules.embedding_bag import EmbeddingBagCollection
from recopt.modules.fused import EmbeddingFusedOptimizer, FusedEmbeddingBagCollection
from recopt.modules.inputs import InvalidIdError, NonFiniteWeightError
from recopt.modules.torch_optimizers import fuse_embedding_optimizer, fused_config

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingFusedOptimizer",
    "FusedEmbeddingBagCollection",
    "FusedOptimizerConfig",
    "InvalidIdError",
    "NonFiniteWeightError",
    "PoolingType",
    "fuse_embedding_optimizer",
    "fused_config",
    "validate_tables",
]
