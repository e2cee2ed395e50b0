"""A sharded collection's input stage, runnable ahead of its forward (for pipelined training).

`start_distribution` checks a batch's ids, routes them and starts the count exchange;
`DistributedInput.advance` reads it and starts the id all-to-all; `DistributedInput.wait`
finishes. A pipeline starts batch i+1's distribution before batch i's forward and advances it
after that forward, so both all-to-alls overlap batch i's compute. Only ids move early (lookups
still follow batch i's update); an error found then (a bad id on any rank, which every rank
learns in the count exchange) is kept and raised at batch i+1's forward, on every rank, so
batch i still trains.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recopt.modules.inputs import FeatureLayout
from recopt.modules.variable_batch import regular_batch
from recopt.sharding.bucketizer import Bucketizer
from recopt.sharding.input_dist import (
    CountExchange,
    InputInFlight,
    ReceivedInput,
    start_count_exchange,
)
from recopt.sparse import KeyedJaggedTensor

Tensor = torch.Tensor


@dataclass(slots=True)
class DistributedInput:
    """One batch's input distribution, started; `wait` gives what the forward needs.

    Attributes:
        features: the input as the forward receives it (matched by identity).
        prepared: the checked input in layout order (None when it was rejected).
        index_F_B: a variable batch's inverse indices (`regular_batch`), else None.
        counts: the count exchange in flight, until `advance`.
        in_flight: the id all-to-all in flight, once `advance` started it.
        error: why the batch was rejected, on this rank or another (raised by `wait`).
    """

    features: KeyedJaggedTensor
    prepared: KeyedJaggedTensor | None
    index_F_B: Tensor | None
    counts: CountExchange | None
    in_flight: InputInFlight | None = None
    error: ValueError | None = None
    ahead: Any = None  # id maps: the owners' step taken ahead, on the worker (`AheadRemap`)

    def advance(self, timeout: datetime.timedelta) -> None:
        """Read the count exchange and start the id all-to-all (collective; once). A rejected
        input (here or on another rank) is kept in ``error``: every rank learns it here and
        sends nothing more."""
        if self.counts is None:
            return
        counts, self.counts = self.counts, None
        try:
            self.in_flight = counts.start_ids(timeout)
        except ValueError as e:  # this rank's error, the check's, or RemoteInputError
            self.error = e

    def drain(self, timeout: datetime.timedelta) -> None:
        """Finish this distribution's collectives and drop its result (every rank drains the
        same one: a batch the pipeline starts again)."""
        self.advance(timeout)
        if self.error is None and self.in_flight is not None:
            self.in_flight.wait(timeout)

    def wait(
        self, timeout: datetime.timedelta
    ) -> tuple[KeyedJaggedTensor, Tensor | None, ReceivedInput]:
        """``(prepared, index_F_B, received)``; may be called again (a step retried).

        Raises:
            The batch's deferred error (InvalidIdError, RemoteInputError, ...), every call.
        """
        self.advance(timeout)
        if self.error is not None:
            raise self.error
        assert self.prepared is not None and self.in_flight is not None
        return self.prepared, self.index_F_B, self.in_flight.wait(timeout)


def start_distribution(
    features: KeyedJaggedTensor,
    layout: FeatureLayout,
    is_weighted: bool,
    bucketizer: Bucketizer,
    group: dist.ProcessGroup | None,
    rank: int,
    raw_tables: Collection[str] = (),
) -> DistributedInput:
    """Check and route ``features`` and start the count exchange (collective); the result's
    `DistributedInput.advance` starts the id all-to-all, its ``wait`` finishes.
    ``raw_tables``: the id-mapped tables (their raw ids are not checked: any int64 is one).

    A rejected input is not raised here (see `DistributedInput.advance`).
    """
    prepared: KeyedJaggedTensor | None = None
    index_F_B: Tensor | None = None
    check = None
    error: ValueError | None = None
    try:
        regular, index_F_B = regular_batch(features, layout.feature_names)
        # The id check's answer rides in the count exchange: no read of its own.
        prepared, check = layout.prepare_deferred(regular, is_weighted, raw_tables=raw_tables)
    except ValueError as e:
        error = e
    counts = start_count_exchange(prepared, error, bucketizer, is_weighted, group, rank, check)
    return DistributedInput(features, prepared, index_F_B, counts)
