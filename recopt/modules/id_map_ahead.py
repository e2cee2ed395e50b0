"""Id-map steps taken ahead of their batch's forward, for pipelined training.

A pipeline remaps batch i+1 while batch i trains (the native remap on a worker thread). Such an
*ahead* step changes the maps at once (the step after it must see it) but is not yet part of
the model: its fresh rows are reset only when its batch's forward takes it (batch i may still
read and update a row that step evicted), and until then `state_dict` writes the maps as they
were before it. An eval read, a load, a training remap outside the pipeline, a batch that never
reached its forward, a copy or pickle of the maps, or fault tolerance starting to watch them
puts the maps back (`AheadSteps.rewind`: the steps' undo records, newest first) and makes the
pending steps stale, so the pipeline remaps their batches again. A pipelined run therefore
equals the plain loop, checkpoints, validation and copies included.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from recopt.modules.id_map import IdMap
from recopt.modules.id_map_results import MapUndo, RemapStats
from recopt.sparse import KeyedJaggedTensor

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


class _Busy:
    """The remap worker's busy seconds in this process (written by the worker thread only)."""

    seconds = 0.0


def worker_busy_seconds() -> float:
    """Seconds the remap worker thread has spent on ahead steps in this process so far (the
    native remap, its Python and torch ops, the fresh values): beside the training step, on
    its own core where there is one. `TrainPipelineSparseDist` logs it as ``remap_worker``."""
    return _Busy.seconds


def _timed(step: Callable[[], None]) -> None:
    start = time.perf_counter()
    try:
        step()
    finally:
        _Busy.seconds += time.perf_counter() - start


def remap_worker() -> ThreadPoolExecutor:
    """The one thread that runs ahead remaps, in the order they were started (every map's
    steps stay in batch order). The native remap releases the GIL, so it runs beside the
    training step's own threads."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recopt-remap")
            atexit.register(_worker.shutdown)
        return _worker


@dataclass(eq=False)
class AheadRemap:
    """One batch's remap, started ahead of its forward (what that forward takes instead).

    Attributes:
        features: the input as the forward receives it (matched by identity).
        generation: the `AheadSteps` generation it was started in (stale once that moved).
        error: the batch's input was rejected (raised at its forward; no map moved).
        index_F_B: a variable batch's inverse indices (`regular_batch`), else None.
        mapped: the remapped batch (a `MappedBatch`), once the step ran.
        undo: per table, what the step changed (`MapUndo`), once it ran.
    """

    features: KeyedJaggedTensor
    generation: int
    error: ValueError | None = None
    index_F_B: torch.Tensor | None = None
    mapped: Any = None
    undo: dict[str, MapUndo] = field(default_factory=dict)
    reset_plan: Any = None  # its fresh rows' reset, worked out on the worker (`ResetPlan`)
    taken: bool = False  # by its forward (a retried step takes it again)
    rows_reset: bool = False  # its fresh rows, by that forward (a retry does not reset them)
    busy_s: float = 0.0  # the step's time on the worker, fresh rows' values aside
    fill_s: float | None = None  # making the fresh rows' values there (None: not made)
    _future: Future[None] | None = None

    def settle(self) -> BaseException | None:
        """Wait for the step (if it runs on the worker); its error, if it raised."""
        if self._future is None:
            return None
        return self._future.exception()


class AheadSteps:
    """The ahead steps of one collection's maps that no forward has taken yet, oldest first."""

    def __init__(self) -> None:
        self.generation = 0
        self._pending: deque[AheadRemap] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def stale(self, remap: AheadRemap) -> bool:
        """Whether ``remap``'s step was undone (or dropped) since it started: its batch must
        be remapped again."""
        return remap.generation != self.generation

    def submit(self, remap: AheadRemap, step: Callable[[], None], background: bool) -> AheadRemap:
        """Queue ``remap`` and run its ``step`` (which fills ``mapped`` and ``undo``): on the
        worker thread when ``background``, else now."""
        self.add(remap)
        if background:
            remap._future = remap_worker().submit(_timed, step)
        else:
            step()
        return remap

    def add(self, remap: AheadRemap) -> None:
        """Queue ``remap``, whose step its caller runs (and records in ``remap.undo``)."""
        self._pending.append(remap)

    def take(self, remap: AheadRemap) -> AheadRemap | None:
        """``remap``, done and now part of the model (the forward resets its fresh rows next,
        once: ``rows_reset`` says whether it did; a retried step takes ``remap`` again); None
        when it is stale (remap the batch now).

        Raises:
            ValueError: the batch's input was rejected, or ``remap`` is not the oldest
                pending step (a pipeline feeds the forwards in the order it started them).
            The step's own error (e.g. MemoryError).
        """
        if remap.taken:  # a step retried on the same batch: its rows as they were
            return remap
        if self.stale(remap):
            return None
        if not self._pending or self._pending[0] is not remap:
            raise ValueError(
                "an id map's remap started ahead was taken out of order: batches must reach "
                "their forward in the order the pipeline started them"
            )
        self._pending.popleft()
        error = remap.settle()
        if error is not None:
            raise error
        if remap.error is not None:
            raise remap.error  # its input was rejected before any map moved
        remap.taken = True
        for undo in remap.undo.values():  # part of the model now: never undone
            undo.release()
        return remap

    def settle(self) -> None:
        """Wait until no pending step runs on the worker."""
        for remap in self._pending:
            remap.settle()

    def rewind(self, maps: Mapping[str, IdMap]) -> None:
        """Put ``maps`` back as they were before every pending step (newest first); those
        steps go stale. Nothing pending: nothing changes."""
        if not self._pending:
            return
        self.settle()
        for remap in reversed(self._pending):
            for name, undo in remap.undo.items():
                maps[name].apply_undo(undo)
        self._forget()

    def _forget(self) -> None:
        self._pending.clear()
        self.generation += 1

    def stats_before(self, maps: Mapping[str, IdMap]) -> dict[str, RemapStats]:
        """Per map, the stats of the last step a forward took (before the pending ones)."""
        stats = {name: idmap.last_stats for name, idmap in maps.items()}
        for remap in reversed(self._pending):  # the oldest's record last: it wins
            remap.settle()
            stats.update({name: undo.stats for name, undo in remap.undo.items()})
        return stats

    def committed(self, name: str, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map ``name``'s ``buffers`` (``step`` and the others by name) as they were before the
        pending steps: copies of those the steps changed, the others as given."""
        out = dict(buffers)
        copied: set[str] = set()
        for remap in reversed(self._pending):
            remap.settle()
            undo = remap.undo.get(name)
            if undo is None:
                continue
            for key in ("step", *undo.row_values, *undo.candidate_values):
                if key not in copied:
                    out[key] = out[key].detach().clone()
                    copied.add(key)
            undo.write_into(out)
        return out

    def committed_state(self, state: MutableMapping[str, Any], prefix: str) -> None:
        """Rewrite a state_dict's map entries (``<prefix><table>.<buffer>``) as before the
        pending steps, on copies (the live maps keep their ahead steps)."""
        self.settle()
        names = {name for remap in self._pending for name in remap.undo}
        for name in names:
            keys = {
                k[len(prefix) + len(name) + 1 :]: k
                for k in state
                if k.startswith(f"{prefix}{name}.")
            }
            committed = self.committed(name, {short: state[key] for short, key in keys.items()})
            for short, key in keys.items():
                state[key] = committed[short]
