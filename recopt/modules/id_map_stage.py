"""A fused collection's id-map remaps started ahead by a pipeline and taken by its forward.

`TrainPipelineSparseDist` calls ``start_remap`` on a collection with id-mapped tables for batch
i+1 before batch i's forward (`start_ahead`: the native remap then runs on the worker thread
during batch i's step), hands it back with ``use_prefetched`` right before batch i+1's forward,
and checks ``prefetch_stale`` before each step (an eval read, a load or a training remap
outside the pipeline undid the ahead steps: the pipeline starts those batches again). The
worker also makes the fresh rows' initial values while it has time for them (`WorkerLoad`),
so the forward's reset only copies them, and works out that reset (`ResetPlan`), so the
forward only writes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recopt.kernels.precision import Precision
from recopt.modules.config import BaseEmbeddingConfig
from recopt.modules.id_map_ahead import AheadRemap
from recopt.modules.id_map_lookup import IdMaps, start_ahead
from recopt.modules.id_map_rows import ResetTargets
from recopt.modules.inputs import FeatureLayout
from recopt.modules.prefetch import PrefetchQueue
from recopt.sparse import KeyedJaggedTensor


class RemapStage:
    """The ahead remaps of one collection's id maps.

    Args:
        owner: the collection's name, for errors.
        id_maps: its maps.
        layout: its features.
        tables: its tables (the fresh rows of float32 uniform-init tables get their initial
            weights made on the worker too).
        is_weighted: whether its input carries per-id weights.
        weight_dtype: the dtype its lookup takes weights in.
    """

    def __init__(
        self,
        owner: str,
        id_maps: IdMaps,
        layout: FeatureLayout,
        tables: Sequence[BaseEmbeddingConfig],
        is_weighted: bool,
        weight_dtype: torch.dtype,
    ) -> None:
        self.id_maps = id_maps
        self._layout = layout
        self._is_weighted = is_weighted
        self._weight_dtype = weight_dtype
        self._queue: PrefetchQueue[AheadRemap] = PrefetchQueue(owner)
        self._load = WorkerLoad()
        self._last_start = time.perf_counter()
        self._fresh_tables = {
            t.name: t
            for t in tables
            if t.name in id_maps and t.init_fn is None and t.weight_dtype is Precision.FP32
        }

    def start(
        self,
        features: KeyedJaggedTensor,
        threads: int | None,
        host_features: KeyedJaggedTensor | None = None,
        reset_targets: ResetTargets | None = None,
    ) -> AheadRemap | None:
        """Remap a training batch ahead of its forward (from ``host_features``, the batch in
        host memory, where the maps are there: `start_ahead`; ``reset_targets``: the tables'
        weights and states, for the worker to plan the fresh rows' reset); None where the
        maps step inline (fault tolerance's observers or peers: the forward remaps it)."""
        if not self.id_maps.can_step_ahead():
            return None
        now = time.perf_counter()
        period, self._last_start = now - self._last_start, now
        fill = self._load.fill_fits(period)
        return start_ahead(
            self.id_maps,
            self._layout,
            features,
            self._is_weighted,
            self._weight_dtype,
            threads,
            self._fresh_tables if fill else None,
            host_features,
            reset_targets,
        )

    def push(self, remap: AheadRemap | None) -> None:
        """Have the forward of ``remap.features`` take ``remap`` (None: nothing to take)."""
        if remap is not None:
            self._queue.push(remap)

    def take(self, features: KeyedJaggedTensor, training: bool) -> AheadRemap | None:
        """The ahead remap of ``features``, done; None when there is none, it is stale or the
        collection is not ``training`` (it was put in eval mode after the remap started: the
        forward only reads the maps, and that read undoes the ahead steps).

        Raises:
            ValueError: the batch's input was rejected (its error), or another input object
                than the one started reached the forward.
        """
        remap = self._queue.take(features)
        if not training:
            return None
        taken = None if remap is None else self.id_maps.ahead.take(remap)
        if taken is not None and not taken.rows_reset:
            self._load.record(taken)
        return taken

    def unused(self) -> int:
        """Ahead remaps no forward took (a step failed before reaching this collection);
        cleared. Their steps and those after them are undone (they go stale)."""
        count = self._queue.pending()
        self._queue.clear()
        if count:
            self.id_maps.rewind_ahead()
        return count

    def stale(self, remap: AheadRemap | None) -> bool:
        """Whether ``remap`` must be started again (its step was undone)."""
        return remap is not None and self.id_maps.ahead.stale(remap)


@dataclass(slots=True)
class WorkerLoad:
    """Whether the worker has time to make the fresh rows' initial values too, measured.

    Making them there saves the forward their hashing (it then copies them), but lengthens
    the worker's step; a worker slower than the training step would delay every forward. So
    they are made there while the worker's step with them fits in 90% of the step period
    (moving averages of the last steps on this machine), else hashed at the forward.
    """

    busy_s: float = 0.0
    fill_s: float | None = None  # unknown until measured once
    weight: float = 0.25  # of the newest measurement in the moving averages

    def record(self, remap: AheadRemap) -> None:
        """Take in a finished step's worker times."""
        self.busy_s += self.weight * (remap.busy_s - self.busy_s)
        if remap.fill_s is not None:
            last = self.fill_s if self.fill_s is not None else remap.fill_s
            self.fill_s = last + self.weight * (remap.fill_s - last)

    def fill_fits(self, period_s: float) -> bool:
        """Whether to make the values on the worker for a step started ``period_s`` after
        the previous one."""
        return self.fill_s is None or self.busy_s + self.fill_s <= 0.9 * period_s
