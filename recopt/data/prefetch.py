"""Batches onto the GPU one step ahead: pinned host memory and a copy on a side CUDA stream.

While the model computes on batch i, batch i+1 is pinned and copied on its own stream, so a step
never waits for its host-to-device transfer. On a CPU device batches pass through unchanged. The
position saved in a checkpoint is that of the last batch handed out, not of the one in flight.
"""

from __future__ import annotations

from typing import Any

import torch

from recopt.data.batch import Batch, BatchIterator


class DevicePrefetcher:
    """A `BatchIterator` of ``source``'s batches on ``device`` (one batch ahead on CUDA).

    Args:
        source: the batches, on CPU.
        device: where the model runs.
    """

    def __init__(self, source: BatchIterator, device: torch.device) -> None:
        self.source = source
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._ahead: tuple[Batch, dict[str, Any]] | None = None
        self._handed_out: dict[str, Any] | None = None  # source state after the last batch out
        self._exhausted = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        if self._stream is None:
            return next(self.source).to(self.device)
        if self._ahead is None:
            self._ahead = self._fetch()
        if self._ahead is None:
            raise StopIteration
        batch, state = self._ahead
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for tensor in _tensors(batch):  # allocated on the side stream, used on this one
            tensor.record_stream(current)
        self._handed_out = state
        self._ahead = self._fetch()
        return batch

    def _fetch(self) -> tuple[Batch, dict[str, Any]] | None:
        if self._exhausted:
            return None
        try:
            batch = next(self.source)
        except StopIteration:
            self._exhausted = True
            return None
        state = self.source.state_dict()
        pinned = pin_batch(batch)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            return pinned.to(self.device, non_blocking=True), state

    def state_dict(self) -> dict[str, Any]:
        """The source's position after the last batch handed out (not the one prefetched)."""
        if self._handed_out is not None:
            return dict(self._handed_out)
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state``; a batch already prefetched is dropped."""
        self.source.load_state_dict(state)
        self._ahead, self._handed_out, self._exhausted = None, None, False


def pin_batch(batch: Batch) -> Batch:
    """The batch with every tensor in page-locked host memory (so copies can be asynchronous)."""
    return batch.pin_memory()


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return [batch.dense, batch.labels, *batch.sparse.tensors()]
