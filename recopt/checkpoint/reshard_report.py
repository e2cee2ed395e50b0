"""What `recopt-reshard` and the export report: progress after each tensor, and the totals.

The tally counts tensors and bytes as they are written and reports them to the progress
callback; the report adds the tables and, for id-mapped tables placed for a plan, the ids
moved and dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recopt.checkpoint.keys import model_tables, table_of
from recopt.checkpoint.manifest import Manifest
from recopt.sharding.id_map_relocate import TableRelocation

__all__ = ["Progress", "ProgressFn", "ReshardReport", "Tally", "nbytes"]


@dataclass(slots=True)
class Progress:
    """Where a reshard or export stands, passed to the progress callback after each tensor."""

    done_tensors: int
    total_tensors: int
    done_bytes: int
    total_bytes: int
    seconds: float
    key: str


@dataclass(slots=True)
class ReshardReport:
    """What a reshard or export did."""

    tensors: int
    tables: int
    bytes: int
    seconds: float
    source_world_size: int
    target_world_size: int | None
    id_map_tables: int = 0
    id_rows_moved: int = 0
    id_rows_dropped: int = 0
    id_candidates_moved: int = 0
    id_candidates_dropped: int = 0

    def add_placement(self, counts: TableRelocation) -> None:
        """Counts one id-mapped table's ids placed for the target plan (`place_ids`)."""
        self.id_map_tables += 1
        self.id_rows_moved += counts.rows_sent
        self.id_rows_dropped += counts.rows_dropped
        self.id_candidates_moved += counts.candidates_sent
        self.id_candidates_dropped += counts.candidates_dropped


ProgressFn = Callable[[Progress], None]


class Tally:
    """What a rewrite or an export has written since it began, told to ``progress`` per tensor."""

    def __init__(self, manifest: Manifest, progress: ProgressFn | None) -> None:
        self.manifest = manifest
        self.progress = progress
        self.start = time.perf_counter()
        self.total = sum(nbytes(e.shape, e.dtype) for e in manifest.tensors.values())
        self.done = self.done_bytes = 0

    def add(self, key: str, nbytes: int) -> None:
        """Counts tensor ``key`` (``nbytes`` bytes) as written and reports the progress."""
        self.done += 1
        self.done_bytes += nbytes
        if self.progress is not None:
            elapsed = time.perf_counter() - self.start
            total_n = len(self.manifest.tensors)
            self.progress(Progress(self.done, total_n, self.done_bytes, self.total, elapsed, key))

    def report(self, target_world_size: int | None) -> ReshardReport:
        """What was done: tensors, tables, bytes, seconds since the start."""
        tensors = self.manifest.tensors
        owners = model_tables(tensors)
        return ReshardReport(
            tensors=len(tensors),
            tables=len({t for k in tensors if (t := table_of(k, owners))}),
            bytes=self.total,
            seconds=time.perf_counter() - self.start,
            source_world_size=self.manifest.world_size,
            target_world_size=target_world_size,
        )


def nbytes(shape: list[int], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and dtype name ``dtype`` (``float32``)."""
    return torch.Size(shape).numel() * getattr(torch, dtype).itemsize
