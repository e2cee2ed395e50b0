"""A `StepTransaction` alone in its quorum, for the cheapest fault-tolerance tests.

It runs the engine-independent half of a step (errors, the non-finite check of the averaged
gradients, the participants' rollback, the min_replica_size rule) without torchft: every
`start_quorum` forms a quorum of one, and the vote commits whatever this replica says.
"""

from __future__ import annotations

import datetime

from recopt.ft.steps import StepTransaction


class SoloTransaction(StepTransaction):
    """A replica group on its own; ``min_replica_size`` > 1 makes every step drop."""

    def __init__(self, min_replica_size: int = 1) -> None:
        super().__init__("solo", min_replica_size, datetime.timedelta(seconds=10))
        self._step = 0

    def start_quorum(self) -> None:
        self._errored = None
        self._num_participants = 1
        self._begin()

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._step

    def shutdown(self) -> None:
        pass

    def _vote(self, ok: bool) -> bool:
        return ok

    def _on_commit(self) -> None:
        self._step += 1
