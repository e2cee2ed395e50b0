"""``torchrec.modules.embedding_configs``: recopt's table configs.

``DataType`` is recopt's `Precision` (``FP32``, ``FP16``, ``BF16``); a table's ``data_type`` is
recopt's ``weight_dtype`` field (see docs/torchrec.md).
"""

from recopt.kernels.precision import Precision as DataType
from recopt.modules import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "PoolingType",
]
