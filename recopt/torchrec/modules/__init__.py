"""``torchrec.modules``: recopt's embedding modules, TorchRec's MLP signature."""

from recopt.torchrec.modules import (  # noqa: F401
    embedding_configs,
    embedding_modules,
    fused_embedding_modules,
    mlp,
)
