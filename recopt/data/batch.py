"""The batch every recopt data source yields, and the protocol of a resumable batch iterator.

A batch carries its position (batches this rank has consumed, this one included), so a
checkpoint taken after step ``s`` stores ``iterator.state_dict()`` and resumes at batch s+1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import torch

from recopt.sparse import KeyedJaggedTensor


class Batch(NamedTuple):
    """One rank's batch of B samples.

    Attributes:
        dense: float32 ``[B, num_dense]`` (log-transformed counts for Criteo).
        sparse: the categorical ids, one key per feature, stride B.
        labels: float32 ``[B]`` of 0.0 / 1.0 (click or not).
        position: batches this rank's iterator has yielded, this one included.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    position: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Returns the batch with every tensor on ``device``."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position,
        )

    def pin_memory(self) -> Batch:
        """The batch with every tensor in page-locked host memory (for asynchronous copies).

        The sparse part goes through ``KeyedJaggedTensor.pin_memory``, which keeps every field
        (a variable batch's ``stride_per_key_per_rank`` and ``inverse_indices`` included).
        """
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.labels.pin_memory(),
            self.position,
        )


class BatchIterator(Protocol):
    """An iterator of batches whose position can be saved and restored exactly."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
