"""Pipelined training: batch i+1's input distribution and batch i+2's copy overlap batch i's step.

TorchRec's ``TrainPipelineSparseDist`` contract: ``progress(dataloader_iter)`` runs one step and
returns the model's output; the model's forward takes a batch and returns ``(loss, output)``.
Only ids move early: batch i+1's lookups still run after batch i's fused update, so a pipelined
run equals the plain loop exactly. Id-mapped tables also step their maps for batch i+1 ahead,
on a worker thread (one process: from the batch, during batch i's step; sharded: at the owners,
from the raw ids as they arrive, during batch i's backward), kept pending until its forward
(docs/id_map.md). The same
loop serves one process (no sharded collection: the copy stage and id-map remaps) and many.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from recopt.modules import FusedEmbeddingBagCollection
from recopt.modules.id_map_ahead import worker_busy_seconds
from recopt.modules.id_map_lookup import rewind_ahead_steps
from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from recopt.sharding.sharded_embedding_collection import ShardedEmbeddingCollection
from recopt.sparse import KeyedJaggedTensor

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
PHASES = ("copy", "input_dist", "forward", "backward", "optimizer")
Sharded = ShardedEmbeddingBagCollection | ShardedEmbeddingCollection


@dataclass(slots=True)
class _Queued:
    """A batch in the pipeline: on the device, then with its input distribution started."""

    batch: Any
    data_state: dict[str, Any] | None  # the iterator's state right after this batch
    started: list[Any] | None = None  # per sharded collection, once distributed
    remaps: list[Any] | None = None  # per unsharded id-mapped collection, once remapped
    copy_done: Any = None  # the side stream's event (CUDA)
    host: Any = None  # the batch in host memory (CUDA, id maps: they remap from it)


def default_sparse_input(batch: Any) -> KeyedJaggedTensor:
    """The batch's sparse features: ``batch.sparse`` (recopt) or ``batch.sparse_features``."""
    for name in ("sparse", "sparse_features"):
        value = getattr(batch, name, None)
        if isinstance(value, KeyedJaggedTensor):
            return value
    raise ValueError(
        f"TrainPipelineSparseDist: a batch of type {type(batch).__name__} has no "
        "KeyedJaggedTensor attribute 'sparse' or 'sparse_features'; pass "
        "sparse_input=<function returning the KeyedJaggedTensor the model's sharded "
        "collection receives>"
    )


@dataclass
class _Stats:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0


class TrainPipelineSparseDist:
    """Train a (sharded) model one batch per `progress`, its next batches already on their way.

    Each call: copy batch i+2 to ``device`` (on a side stream on CUDA), start batch i+1's input
    distribution (routing, count exchange started), then zero_grad and forward of batch i,
    whose sharded collections consume the ids already distributed; then batch i+1's counts are
    read and its id all-to-all started, running during batch i's backward and step. The
    pipeline fills itself on the first call and drains when the iterator ends; `progress`
    then raises ``StopIteration`` (and keeps raising it until `reset`).

    Args:
        model: takes a batch, returns ``(loss, output)``; its sharded collections
            (`DistributedModelParallel` or built directly) are found in ``model.modules()``.
        optimizer: the dense optimizer (fused tables update in backward); None: no step.
        device: where the model runs; batches are moved there.
        sparse_input: the KeyedJaggedTensor of a batch (on the device) that the model passes
            to its sharded collections (default `default_sparse_input`).
        step_committed: called after ``optimizer.step()``; False keeps the batch at the head
            of the pipeline and trains it again at the next call, reusing its distributed ids
            (a fault-tolerant step dropped to be retried). None: every step is final.
        timeout: bound of every wait for an input distribution.
        remap_threads: threads of the native remap that steps an unsharded collection's id
            maps for batch i+1 on the worker thread (None: torch's).

    Raises:
        ValueError: a batch has no sparse input ``sparse_input`` can find, or the model
            passes its sharded collection another input than the one distributed ahead.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str,
        *,
        sparse_input: Callable[[Any], KeyedJaggedTensor] = default_sparse_input,
        step_committed: Callable[[], bool] | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        remap_threads: int | None = 1,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.sparse_input = sparse_input
        self.step_committed = step_committed
        self.timeout = timeout
        self.sharded: list[Sharded] = _outermost_sharded(model)
        self.remapping = _id_mapped_collections(model)
        self.remap_threads = remap_threads
        self._queue: deque[_Queued] = deque()
        self._exhausted = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._trained_state: dict[str, Any] | None = None
        self._stats = _Stats()
        self._worker_seen = worker_busy_seconds()
        self._training = True
        # an earlier pipeline's batches in flight never reach a forward: their steps undone
        rewind_ahead_steps(self.model)

    # ------------------------------------------------------------------------------ public
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step; return the model's output for it.

        Raises:
            StopIteration: every batch of ``dataloader_iter`` was trained.
            The step's own errors (a bad id of this batch raises here, on every rank, with
            nothing updated; the pipeline then continues with the next batch).
        """
        while len(self._queue) < 2 and not self._exhausted:
            self._copy_next(dataloader_iter)
        if not self._queue:
            raise StopIteration
        self._restart_if_stale()
        self._start_input_dist(self._queue[0])
        if len(self._queue) < 3:  # (a batch kept for a retry leaves 3 queued already)
            self._copy_next(dataloader_iter)  # batch i+2
        if len(self._queue) > 1:
            self._start_input_dist(self._queue[1])  # batch i+1
        head = self._queue[0]
        try:
            output, done = self._step(head)
        except BaseException:
            self._queue.popleft()  # a failed batch is not retried
            raise
        if done:
            self._queue.popleft()
            self._trained_state = head.data_state
        return output

    def data_state(self) -> dict[str, Any] | None:
        """The iterator's ``state_dict()`` right after the last batch trained (None: none yet,
        or the iterator has no state): what a checkpoint saves, not the iterator's own state,
        which is up to two batches ahead."""
        return None if self._trained_state is None else dict(self._trained_state)

    def reset(self) -> None:
        """Drop the batches in flight (after loading a checkpoint: the next `progress` refills
        from the iterator's restored position); the id maps' steps taken ahead for them are
        undone."""
        rewind_ahead_steps(self.model)
        self._queue.clear()
        self._exhausted = False
        self._trained_state = None

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent per phase (copy, input_dist start, forward, backward, optimizer),
        summed over the steps since the last `reset_phase_seconds`; with id maps remapped
        ahead also ``remap_worker``, the remap worker thread's busy time (beside the step:
        the step waits for it only where it is longer)."""
        return dict(self._stats.seconds)

    @property
    def timed_steps(self) -> int:
        """Steps in `phase_seconds`."""
        return self._stats.steps

    def reset_phase_seconds(self) -> None:
        self._stats = _Stats()
        self._worker_seen = worker_busy_seconds()

    def _count_step(self) -> None:
        """One more step in `phase_seconds`, with the remap worker's time since the last."""
        self._stats.steps += 1
        busy = worker_busy_seconds()
        if busy > self._worker_seen:
            seconds = self._stats.seconds
            seconds["remap_worker"] = seconds.get("remap_worker", 0.0) + busy - self._worker_seen
            self._worker_seen = busy

    # ------------------------------------------------------------------------------ stages
    def _copy_next(self, dataloader_iter: Iterator[Any]) -> None:
        if self._exhausted:
            return
        start = time.perf_counter()
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            self._exhausted = True
            return
        state_dict = getattr(dataloader_iter, "state_dict", None)
        state = state_dict() if callable(state_dict) else None
        event, host = None, None
        if self._stream is not None:
            batch = _pinned(batch)  # an asynchronous copy needs page-locked host memory
            host = batch if self.remapping else None
            with torch.cuda.stream(self._stream):
                batch = batch.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            batch = batch.to(self.device)
        self._queue.append(_Queued(batch, state, copy_done=event, host=host))
        self._record("copy", start)

    def _start_input_dist(self, queued: _Queued) -> None:
        if queued.started is not None:
            return
        start = time.perf_counter()
        if queued.copy_done is not None:  # the copy ran on the side stream
            current = torch.cuda.current_stream(self.device)
            current.wait_event(queued.copy_done)
            _record_stream(queued.batch, current)
        queued.started, queued.remaps = [], [None] * len(self.remapping)
        if self.sharded or (self.remapping and self._training):
            features = self.sparse_input(queued.batch)
            ahead = self._training  # id maps keep a training batch's step pending
            queued.started = [m.start_input_dist(features, ahead) for m in self.sharded]
            if self._training:  # evaluation only reads the maps: in its forward
                threads = self.remap_threads
                # Maps kept on the host remap from the batch there: no read back from the GPU.
                host = None if queued.host is None else self.sparse_input(queued.host)
                queued.remaps = [m.start_remap(features, threads, host) for m in self.remapping]
        self._record("input_dist", start)

    def _restart_if_stale(self) -> None:
        """Start the queued batches again when their id-map steps were undone since they
        started (an evaluation, a load or a training forward outside the pipeline came
        between): the maps must step in batch order. Every collection's ahead steps are
        undone then (one collection's may be stale while another's are not: a load or an
        evaluation of one, a step failing between two), so all start again from the same
        batch. Every rank sees the same (the undoing forwards and loads run on every rank),
        and drains the same distributions."""
        started = [
            (queued, [*queued.started, *queued.remaps])
            for queued in self._queue
            if queued.started is not None and queued.remaps is not None
        ]
        stale = any(
            stage.prefetch_stale(handle)
            for _, handles in started
            for stage, handle in zip(self._stages(), handles, strict=True)
        )
        if stale:
            rewind_ahead_steps(self.model)
            for queued, handles in started:
                for distribution in handles[: len(self.sharded)]:
                    distribution.drain(self.timeout)
                queued.started = queued.remaps = None

    def _step(self, queued: _Queued) -> tuple[Any, bool]:
        """Train (or evaluate) one batch; whether it is done (not to be retried)."""
        assert queued.started is not None and queued.remaps is not None
        for module, started in zip(self.sharded, queued.started, strict=True):
            module.use_prefetched(started)
        for collection, remap in zip(self.remapping, queued.remaps, strict=True):
            collection.use_prefetched(remap)
        try:
            return self._run_model(queued.batch)
        finally:
            for stage in self._stages():  # what a forward that failed early left queued
                stage.unused_prefetched()

    def _stages(self) -> list[Sharded | FusedEmbeddingBagCollection]:
        return [*self.sharded, *self.remapping]

    def _run_model(self, batch: Any) -> tuple[Any, bool]:
        start = time.perf_counter()
        if not self._training:
            with torch.no_grad():
                _, output = self.model(batch)
            self._check_consumed()
            self._record("forward", start)
            self._advance_next()
            self._count_step()
            return output, True
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        loss, output = self.model(batch)
        self._check_consumed()
        start = self._record("forward", start)
        start = self._advance_next()
        loss.backward()
        start = self._record("backward", start)
        if self.optimizer is not None:
            self.optimizer.step()
        self._record("optimizer", start)
        self._count_step()
        done = self.step_committed is None or self.step_committed()
        return output, done

    def _advance_next(self) -> float:
        """Read batch i+1's count exchange (in flight during batch i's forward) and start its id
        all-to-all, which then runs during batch i's backward (sharded id maps map its ids on
        the worker thread as they arrive)."""
        start = time.perf_counter()
        if len(self._queue) > 1 and self._queue[1].started:
            for module, started in zip(self.sharded, self._queue[1].started, strict=True):
                module.advance_prefetched(started, self.timeout)
        return self._record("input_dist", start)

    def _check_consumed(self) -> None:
        unused = [m for m in self._stages() if m.unused_prefetched()]
        if unused:
            raise ValueError(
                f"TrainPipelineSparseDist: {len(unused)} collection(s) did not receive "
                "the batch's sparse input in the model's forward (the model passes them "
                "another KeyedJaggedTensor than sparse_input(batch)); pass sparse_input=<the "
                "function returning what the model gives them>, or train without the pipeline"
            )

    def _record(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self._stats.seconds[phase] += now - start
        return now


class EvalPipelineSparseDist(TrainPipelineSparseDist):
    """`TrainPipelineSparseDist` without backward or optimizer: forward under ``no_grad``,
    the next batches' copy and input distribution still overlapped."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        *,
        sparse_input: Callable[[Any], KeyedJaggedTensor] = default_sparse_input,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(model, None, device, sparse_input=sparse_input, timeout=timeout)
        self._training = False


def _outermost_sharded(model: nn.Module) -> list[Sharded]:
    """The model's sharded collections (an embedding collection's engine is not listed)."""
    return [m for m in model.modules() if isinstance(m, Sharded)]


def _id_mapped_collections(model: nn.Module) -> list[FusedEmbeddingBagCollection]:
    """The model's unsharded fused collections with id-mapped tables (remapped ahead)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, FusedEmbeddingBagCollection) and m.id_maps is not None
    ]


def _pinned(batch: Any) -> Any:
    """The batch in page-locked memory, by its own ``pin_memory()`` (recopt's and TorchRec's
    batches have one); other batches are copied as they are."""
    pin = getattr(batch, "pin_memory", None)
    return pin() if callable(pin) else batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    """Tell the allocator that the batch's tensors (made on the side stream) are used here."""
    for value in _tensors(batch):
        value.record_stream(stream)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, KeyedJaggedTensor):
        weights = value.weights_or_none()
        found = [value.values(), value.lengths()]
        return found if weights is None else [*found, weights]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "__dict__"):
        return [t for v in vars(value).values() for t in _tensors(v)]
    return []


class TrainedPosition:
    """The data position a checkpoint of a pipelined run saves: after the last batch trained.

    Give it as a checkpoint extra (``extra={"data": TrainedPosition(pipeline, iterator)}``):
    the iterator itself is up to two batches ahead of the training. Loading restores the
    iterator and drops the pipeline's batches in flight, so a resume loses and repeats nothing.

    Args:
        pipeline: the pipeline that trains from ``iterator``.
        iterator: the batches; has ``state_dict`` and ``load_state_dict``.
    """

    def __init__(self, pipeline: TrainPipelineSparseDist, iterator: Any) -> None:
        self.pipeline = pipeline
        self.iterator = iterator
        self._start: dict[str, Any] = iterator.state_dict()  # before any batch of the pipeline

    def state_dict(self) -> dict[str, Any]:
        trained = self.pipeline.data_state()
        return dict(self._start) if trained is None else trained

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iterator.load_state_dict(state)
        self.pipeline.reset()
        self._start = self.iterator.state_dict()
