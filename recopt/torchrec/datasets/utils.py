"""``torchrec.datasets.utils.Batch``: dense features, sparse features and labels of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recopt.sparse import KeyedJaggedTensor


@dataclass
class Batch:
    """One batch: ``dense_features`` [B, D], ``sparse_features`` (a KJT), ``labels`` [B]."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on ``device``."""
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The batch in pinned host memory."""
        return Batch(
            self.dense_features.pin_memory(),
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
        )
