"""Embedding modules: pooled bags (EmbeddingBagCollection) and unpooled rows (EmbeddingCollection),
each as a plain torch module and a fused-optimizer twin."""

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules.collection import FusedCollection
from recopt.modules.config import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    validate_tables,
)
from recopt.modules.embedding import EmbeddingCollection
from recopt.modules.embedding_bag import EmbeddingBagCollection
from recopt.modules.fused import (
    EmbeddingFusedOptimizer,
    FusedEmbeddingBagCollection,
    fuse_embedding_optimizer,
)
from recopt.modules.fused_embedding import FusedEmbeddingCollection
from recopt.modules.id_map import IdMapConfig
from recopt.modules.inputs import InvalidIdError, NonFiniteWeightError
from recopt.modules.torch_optimizers import fused_config

__all__ = [
    "BaseEmbeddingConfig",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingFusedOptimizer",
    "FusedCollection",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "FusedOptimizerConfig",
    "IdMapConfig",
    "InvalidIdError",
    "NonFiniteWeightError",
    "PoolingType",
    "fuse_embedding_optimizer",
    "fused_config",
    "validate_tables",
]
