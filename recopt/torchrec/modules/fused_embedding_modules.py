"""``torchrec.modules.fused_embedding_modules``: recopt's fused collections."""

from recopt.modules import (
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    fuse_embedding_optimizer,
)

__all__ = ["FusedEmbeddingBagCollection", "FusedEmbeddingCollection", "fuse_embedding_optimizer"]
