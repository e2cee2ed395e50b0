"""``torchrec.distributed.embeddingbag``: the sharder of (fused) EmbeddingBagCollections."""

from recopt.modules import EmbeddingBagCollection, FusedEmbeddingBagCollection
from recopt.sharding import ShardedEmbeddingBagCollection
from recopt.torchrec.distributed.types import ModuleSharder

__all__ = ["EmbeddingBagCollectionSharder", "ShardedEmbeddingBagCollection"]


class EmbeddingBagCollectionSharder(ModuleSharder):
    """``EmbeddingBagCollectionSharder(fused_params=None, qcomm_codecs_registry=None)``."""

    module_types = (EmbeddingBagCollection, FusedEmbeddingBagCollection)
