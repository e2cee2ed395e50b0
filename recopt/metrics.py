"""Click-prediction metrics: AUROC, accuracy and normalized entropy, synchronised across ranks.

Normalized entropy (He et al. 2014, "Practical lessons from predicting clicks on ads") is the
mean log loss of the predictions divided by the entropy of the empirical click rate: 1.0 is
no better than always predicting the average CTR, lower is better. All three are torchmetrics
``Metric`` objects, so ``compute()`` sums their states over the process group first.
"""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

# Probabilities are clamped this far from 0 and 1 so one confident mistake costs a finite loss.
_EPS = 1e-7


class NormalizedEntropy(torchmetrics.Metric):
    """NE = (-1/N sum y log p + (1-y) log(1-p)) / H(ctr), ctr = mean(y), H the binary entropy.

    ``update(probabilities [B], labels [B])`` with probabilities in [0, 1] and labels 0/1.
    ``compute()`` returns NaN when there are no samples or the labels are all equal (the
    entropy of the click rate is then 0).

    Args:
        **kwargs: passed to ``torchmetrics.Metric`` (``process_group``, ``sync_on_compute``...).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    cross_entropy_sum: torch.Tensor
    positives: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("cross_entropy_sum", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("positives", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("count", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch.

        Args:
            preds: click probabilities, any shape.
            target: 0/1 labels of the same shape.

        Raises:
            ValueError: if the shapes differ.
        """
        if preds.shape != target.shape:
            raise ValueError(
                f"NormalizedEntropy: preds shape {list(preds.shape)} differs from target "
                f"shape {list(target.shape)}"
            )
        p = preds.detach().to(torch.float64).clamp(_EPS, 1.0 - _EPS)
        y = target.detach().to(torch.float64)
        loss = -(y * torch.log(p) + (1.0 - y) * torch.log1p(-p))
        self.cross_entropy_sum += loss.sum()
        self.positives += y.sum()
        self.count += y.numel()

    def compute(self) -> torch.Tensor:
        """Returns NE as a float64 scalar (NaN without samples or with a single class)."""
        if self.count == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        ctr = self.positives / self.count
        entropy = -(ctr * torch.log(ctr) + (1.0 - ctr) * torch.log1p(-ctr))
        if not entropy > 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return (self.cross_entropy_sum / self.count) / entropy


def click_metrics(
    process_group: Any = None, auroc_thresholds: int | None = None
) -> torchmetrics.MetricCollection:
    """AUROC, accuracy (threshold 0.5) and NE; ``update(probabilities, labels)``.

    Args:
        process_group: the group to synchronise over on ``compute()`` (None: the default
            group when torch.distributed is initialised, else no sync).
        auroc_thresholds: None keeps every prediction (exact AUROC, memory grows with the
            samples until ``reset()``); an int bins them (constant memory, approximate).

    Returns:
        A ``MetricCollection`` with keys ``auc``, ``accuracy`` and ``ne``, updated with
        ``(probabilities [B] float, labels [B] int64)`` (torchmetrics' binary metrics
        reject float labels, and given values outside [0, 1] they guess logits).
    """
    common: dict[str, Any] = {"process_group": process_group}
    return torchmetrics.MetricCollection(
        {
            "auc": BinaryAUROC(thresholds=auroc_thresholds, **common),
            "accuracy": BinaryAccuracy(**common),
            "ne": NormalizedEntropy(**common),
        },
        compute_groups=False,
    )
