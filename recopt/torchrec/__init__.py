"""TorchRec's public import paths over recopt: ``sed 's/\\btorchrec\\b/recopt.torchrec/g'``
moves TorchRec code (as its README, tutorials and examples write it) onto recopt.

Every name here is recopt's own class or function, or a thin adapter that takes TorchRec's
signature and calls it; nothing is implemented twice. What still differs, and why, is listed
in docs/torchrec.md.
"""

from recopt.torchrec import distributed, models, modules, optim, sparse  # noqa: F401
from recopt.torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recopt.torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recopt.torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "distributed",
    "models",
    "modules",
    "optim",
    "sparse",
]
