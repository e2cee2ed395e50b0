"""What a pipeline started ahead of a module's forward, waiting for that forward.

A pipeline starts batch i+1's input stage (a sharded collection's distribution, an id map's
remap) before batch i's forward, and hands it to the module right before batch i+1's forward,
which takes it instead of starting its own. The forward must receive the very input object
the pipeline started (matched by identity).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar

from recopt.sparse import KeyedJaggedTensor


class _Started(Protocol):
    @property
    def features(self) -> KeyedJaggedTensor: ...


StartedT = TypeVar("StartedT", bound=_Started)


class PrefetchQueue(Generic[StartedT]):
    """Input stages a pipeline started, waiting for the forward of their batch."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._queued: deque[StartedT] = deque()

    def push(self, started: StartedT) -> None:
        self._queued.append(started)

    def take(self, features: KeyedJaggedTensor) -> StartedT | None:
        """The queued stage of ``features`` (None when nothing is queued).

        Raises:
            ValueError: one is queued for another input object: the model gives the module
                something else than what the pipeline started.
        """
        if not self._queued:
            return None
        if self._queued[0].features is not features:
            self._queued.clear()
            raise ValueError(
                f"{self._owner}: forward received another KeyedJaggedTensor than the one the "
                "pipeline started ahead of it (the model transforms or rebuilds its sparse "
                "input); give the pipeline a `sparse_input` function returning the exact object "
                "the model passes to this module, or train without the pipeline"
            )
        return self._queued.popleft()

    def pending(self) -> int:
        """Stages no forward has taken."""
        return len(self._queued)

    def clear(self) -> None:
        self._queued.clear()
