"""The DLRM script's pipelined loop (``training.pipeline = true``): recopt's
TrainPipelineSparseDist over the script's model, and its phase times for the metrics log.

While batch i trains, batch i+1's ids are already being distributed to the ranks that own
their rows and batch i+2 is copied to the device; the result equals the plain loop's exactly.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from dlrm_nonfinite import poison_if_nonfinite
from torch import nn

from recopt.data import Batch
from recopt.sharding import TrainedPosition, TrainPipelineSparseDist


class LossAndLogits(nn.Module):
    """The pipeline's model contract: ``batch -> (loss, (loss, logits, labels))``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logits = self.model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        # NaN/inf in the loss or the dense input: every gradient NaN, so no table steps.
        poisoned = poison_if_nonfinite(loss, batch.dense)
        return poisoned, (loss.detach(), logits.detach(), batch.labels)


def build_pipeline(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: Any,
    device: torch.device,
    timeout_s: float,
    step_committed: Callable[[], bool] | None = None,
    remap_threads: int = 1,
) -> tuple[TrainPipelineSparseDist, TrainedPosition]:
    """The pipeline over ``model``, and the data position a checkpoint saves (after the last
    batch trained, not the iterator's, which is two batches ahead). ``step_committed``: under
    fault tolerance, False retrains the batch (a dropped step); ``remap_threads``: the
    native remap's threads on the pipeline's worker (an unsharded model's id maps)."""
    pipeline = TrainPipelineSparseDist(
        LossAndLogits(model),
        optimizer,
        device,
        step_committed=step_committed,
        timeout=datetime.timedelta(seconds=timeout_s),
        remap_threads=remap_threads,
    )
    return pipeline, TrainedPosition(pipeline, source)


def phase_milliseconds(pipeline: TrainPipelineSparseDist) -> dict[str, float]:
    """``pipeline_<phase>_ms``: milliseconds per step of each phase since the last call (then
    restarts the count)."""
    steps = max(pipeline.timed_steps, 1)
    seconds = pipeline.phase_seconds
    result = {f"pipeline_{k}_ms": round(1000.0 * v / steps, 3) for k, v in seconds.items()}
    pipeline.reset_phase_seconds()
    return result
