"""``torchrec.distributed.embedding``: the sharder of (fused) EmbeddingCollections."""

from recopt.modules import EmbeddingCollection, FusedEmbeddingCollection
from recopt.sharding import ShardedEmbeddingCollection
from recopt.torchrec.distributed.types import ModuleSharder

__all__ = ["EmbeddingCollectionSharder", "ShardedEmbeddingCollection"]


class EmbeddingCollectionSharder(ModuleSharder):
    """``EmbeddingCollectionSharder(fused_params=None, qcomm_codecs_registry=None)``."""

    module_types = (EmbeddingCollection, FusedEmbeddingCollection)
