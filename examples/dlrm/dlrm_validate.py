"""The DLRM example's validation pass: metrics over the held-out batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchmetrics
from dlrm_build import RunEnv, build_data
from dlrm_config import TrainingConfig
from torch import nn

from recopt.metrics import click_metrics


@torch.no_grad()
def evaluate(model: nn.Module, config: TrainingConfig, env: RunEnv, clock: int) -> dict[str, float]:
    """Loss, AUC and the other click metrics over ``data.val_batches`` held-out batches (the
    same ones every time; ``clock``: the global batches trained, a drifting source's time).
    Empty when there is no validation data. Leaves ``model`` in eval mode."""
    if config.data.val_batches == 0:
        return {}
    data = build_data(config, env, "val", clock=clock)
    if data is None:  # a source without validation data
        return {}
    model.eval()
    metrics = click_metrics().to(env.device)
    loss_mean = torchmetrics.MeanMetric().to(env.device)
    for i, batch in enumerate(data):
        if i >= config.data.val_batches:
            break
        batch = batch.to(env.device)
        logits = model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        metrics.update(torch.sigmoid(logits), batch.labels.long())
        loss_mean.update(loss, weight=batch.labels.numel())
    values = {k: float(v) for k, v in metrics.compute().items()}
    values["loss"] = float(loss_mean.compute())
    return values
