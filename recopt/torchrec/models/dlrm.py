"""``torchrec.models.dlrm``: TorchRec's DLRM constructors over recopt's `DLRM`.

``DLRM(ebc, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes)`` is recopt's
DLRM with ``bottom_mlp=dense_arch_layer_sizes`` and ``top_mlp=over_arch_layer_sizes[:-1]``
(recopt adds the final layer to one logit); ``forward(dense_features, sparse_features)``
returns logits ``[B, 1]`` as TorchRec's does. Parameter names are recopt's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recopt.models import DLRM as _RecoptDLRM
from recopt.models import DLRMConfig
from recopt.sparse import KeyedJaggedTensor
from recopt.torchrec.datasets.utils import Batch


def _config(
    dense_in_features: int,
    dense_arch_layer_sizes: Sequence[int],
    over_arch_layer_sizes: Sequence[int],
    **interaction: int | str,
) -> DLRMConfig:
    if not over_arch_layer_sizes or over_arch_layer_sizes[-1] != 1:
        raise ValueError(
            f"over_arch_layer_sizes {list(over_arch_layer_sizes)} must end with 1 (the logit "
            "layer); recopt's DLRM predicts one logit per sample"
        )
    return DLRMConfig(
        dense_in_features=dense_in_features,
        bottom_mlp=tuple(dense_arch_layer_sizes),
        top_mlp=tuple(over_arch_layer_sizes[:-1]),
        **interaction,  # type: ignore[arg-type]
    )


class DLRM(_RecoptDLRM):
    """DLRM with the dot interaction (TorchRec's signature).

    Args:
        embedding_bag_collection: the sparse features' EmbeddingBagCollection.
        dense_in_features: dense input width.
        dense_arch_layer_sizes: the dense MLP's widths (the last equals the embedding dim).
        over_arch_layer_sizes: the over MLP's widths, ending with 1.
        dense_device: where the dense layers live (default: CPU).

    Raises:
        ValueError: ``over_arch_layer_sizes`` does not end with 1, or as recopt's DLRM.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dense_device: torch.device | str | None = None,
    ) -> None:
        config = _config(dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes)
        super().__init__(embedding_bag_collection, config)
        _move_dense(self, dense_device)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        """Logits ``[B, 1]``."""
        return super().forward(dense_features, sparse_features).unsqueeze(1)


class DLRM_DCN(DLRM):
    """DLRM with the DCNv2 low-rank cross network as interaction (TorchRec's signature).

    Args:
        embedding_bag_collection, dense_in_features, dense_arch_layer_sizes,
        over_arch_layer_sizes, dense_device: as `DLRM`.
        dcn_num_layers: cross layers.
        dcn_low_rank_dim: rank of each layer's factorised weight.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: torch.device | str | None = None,
    ) -> None:
        config = _config(
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            interaction="dcn",
            dcn_num_layers=dcn_num_layers,
            dcn_low_rank=dcn_low_rank_dim,
        )
        _RecoptDLRM.__init__(self, embedding_bag_collection, config)
        _move_dense(self, dense_device)


def _move_dense(model: _RecoptDLRM, device: torch.device | str | None) -> None:
    if device is not None:
        for part in (model.bottom_mlp, model.interaction, model.top_mlp):
            part.to(device)


class DLRMTrain(nn.Module):
    """A DLRM and its loss: ``forward(batch) -> (loss, (loss, logits, labels))``, detached
    in the tuple, logits ``[B]``; the loss is binary cross-entropy with logits.

    Args:
        dlrm_module: the `DLRM` (or `DLRM_DCN`).
    """

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: Batch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
