"""``torchrec.modules.embedding_modules``: recopt's embedding collections."""

from recopt.modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]
