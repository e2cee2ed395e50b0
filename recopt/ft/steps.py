"""The engine-independent half of a fault-tolerant step: errors, collectives, the vote's outcome.

`StepTransaction` holds what every engine shares: the step's first error, the averaged
gradients (with the NaN/inf check every replica computes on the same sum), the row
all-gathers of the fused-embedding layer, and telling each `StepParticipant` whether the
step committed. The engine (`recopt.ft.torchft_manager.TorchftManager`, on torchft's Manager
and lighthouse; unit tests use stand-ins) supplies the quorum, the process group and the vote
itself (`_vote`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.modules.nonfinite import finite_flag

logger = logging.getLogger(__name__)


class StepParticipant:
    """Something that must learn a step's outcome (e.g. fused embedding rows to roll back)."""

    def on_start(self) -> None:
        """A step begins (after healing): forget anything left from an unfinished step."""

    def before_vote(self) -> None:
        """Last collectives of the step (its errors drop the step); skipped if errored."""

    def on_commit(self) -> None:
        """The step committed."""

    def on_abort(self) -> None:
        """The step was dropped: undo whatever it already applied."""


class StepTransaction:
    """Errors, cross-replica collectives and participants of the current step.

    Subclasses set ``_pg`` (a gloo group over the step's participants, or None when alone),
    ``_rank`` and ``_num_participants`` when a quorum forms, and implement `_vote`.

    Args:
        name: the replica group's name, for log lines.
        min_replica_size: a step commits only with at least this many participants.
        timeout: limit for each collective.
    """

    def __init__(self, name: str, min_replica_size: int, timeout: datetime.timedelta) -> None:
        self._name = name
        self._min_replica_size = min_replica_size
        self._timeout = timeout
        self._errored: Exception | None = None
        self._pg_broken = False
        self._rank = 0
        self._num_participants = 0
        # A gloo group; typed Any because torch's stubs omit its collectives.
        self._pg: Any = None
        self._participants: list[StepParticipant] = []

    def num_participants(self) -> int:
        """Replica groups in the current step's quorum (0 if it did not form)."""
        return self._num_participants

    def participant_rank(self) -> int:
        """This replica's rank in the current quorum."""
        return self._rank

    def errored(self) -> Exception | None:
        """The first error of the current step, if any."""
        return self._errored

    def report_error(self, exc: Exception) -> None:
        """Mark the current step errored (it will be dropped); the first error is kept."""
        if self._errored is None:
            logger.warning("replica %s: step errored: %s", self._name, exc)
            self._errored = exc

    def register_participant(self, participant: StepParticipant) -> None:
        """Have ``participant`` told each step's outcome, in registration order."""
        self._participants.append(participant)

    def start_quorum(self) -> None:
        """Begin a step: join the quorum, heal if behind; errors mark the step errored."""
        raise NotImplementedError

    def current_step(self) -> int:
        """Number of committed steps (restored from the source when healing)."""
        raise NotImplementedError

    def batches_committed(self) -> int:
        """Sum over committed steps of the number of participants (replica batches)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Leave the job: stop serving state and talking to the coordinator."""
        raise NotImplementedError

    def _begin(self) -> None:
        """Tell the participants a step begins (after the quorum and any healing)."""
        for participant in self._participants:
            participant.on_start()

    # -- collectives --------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place over the participants (one flat buffer per dtype).

        A failure or timeout marks the step errored and leaves the tensors unspecified (the
        step will be dropped). Does nothing on an already errored step.

        Args:
            tensors: dense tensors of identical shapes and order on every participant.
        """
        if self._errored is not None or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            if not self._sum(flat):
                return
            flat.div_(self._num_participants)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _sum(self, flat: torch.Tensor) -> bool:
        """All-reduce (sum) in place with the timeout; False (and errored) on failure."""
        if self._num_participants <= 1:
            return True
        try:
            assert self._pg is not None
            work = self._pg.allreduce([flat], dist.AllreduceOptions())
            work.wait(self._timeout)
            return True
        except Exception as exc:  # noqa: BLE001 - a peer died, hung or the group broke
            self._pg_broken = True
            self.report_error(exc)
            return False

    def allreduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average the dense gradients of ``params`` over the participants.

        A parameter without a gradient here counts as a zero gradient if some participant has
        one, and keeps ``grad=None`` if none has (torch optimizers then skip it, as they
        would without fault tolerance). One collective per dtype carries grads and presence.

        Raises:
            ValueError: a gradient is sparse (average it yourself, or use a dense layout).
        """
        if self._errored is not None:
            return
        plist = [p for p in params if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in plist:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(
                    f"parameter of shape {tuple(p.shape)} has a sparse gradient; the Manager "
                    "averages dense gradients only: use a dense layout (sparse=False)"
                )
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            if not self._allreduce_group(group):
                return

    def _allreduce_group(self, group: list[torch.Tensor]) -> bool:
        parts = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in group
        ]
        present = torch.tensor([p.grad is not None for p in group], dtype=group[0].dtype)
        flat = torch.cat([*parts, present.to(group[0].device)])
        if not self._sum(flat):
            return False
        # The same sum on every participant, so all of them drop a NaN/inf step together.
        # One host read: the presence counts and whether every sum is finite.
        flag = finite_flag([flat], flat.device).to(flat.dtype).reshape(1)
        *counts, finite = torch.cat([flat[-len(group) :], flag]).tolist()
        if not finite:
            self.report_error(
                NonFiniteGradientError(
                    "the dense gradients averaged over the replicas hold NaN or inf (some "
                    "replica's loss or gradient is not finite); the step is dropped on every "
                    "replica"
                )
            )
            return False
        offset = 0
        for p, count in zip(group, counts, strict=True):
            if count > 0:
                grad = flat[offset : offset + p.numel()].view_as(p).div_(self._num_participants)
                if p.grad is None:
                    p.grad = grad.clone()
                else:
                    p.grad.copy_(grad)
            offset += p.numel()
        return True

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every participant's ``tensor`` (first dimension may differ), in quorum rank order.

        Returns:
            One tensor per participant, or None if the step errored (it will be dropped).
        """
        if self._errored is not None:
            return None
        if self._num_participants <= 1:
            return [tensor]
        sizes = torch.zeros(self._num_participants, dtype=torch.int64)
        sizes[self._rank] = tensor.shape[0]
        if not self._sum(sizes):
            return None
        longest = int(sizes.max())
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        outputs = [torch.empty_like(padded) for _ in range(self._num_participants)]
        try:
            assert self._pg is not None
            self._pg.allgather([outputs], [padded], AllgatherOptions()).wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 - same failure model as allreduce
            self._pg_broken = True
            self.report_error(exc)
            return None
        return [out[: int(n)] for out, n in zip(outputs, sizes.tolist(), strict=True)]

    # -- the outcome --------------------------------------------------------------------------
    def _vote(self, ok: bool) -> bool:
        """Cast this replica's vote ``ok``; True if the step commits here."""
        raise NotImplementedError

    def _on_commit(self) -> None:
        """Advance the engine's counters after a committed step."""

    def should_commit(self) -> bool:
        """Vote on the current step; True only if it succeeded here and the quorum agrees.

        Participants registered with `register_participant` run their last exchanges first
        and are told the outcome either way (a dropped step is rolled back).
        """
        for participant in self._participants:
            if self._errored is None:
                try:
                    participant.before_vote()
                except Exception as exc:  # noqa: BLE001 - a failed exchange drops the step
                    self.report_error(exc)
        enough = self._num_participants >= self._min_replica_size
        if self._errored is None and not enough:
            logger.warning(
                "replica %s: %d participants < min_replica_size %d; not committing",
                self._name,
                self._num_participants,
                self._min_replica_size,
            )
        commit = self._vote(self._errored is None and enough)
        if commit:
            self._on_commit()
        for participant in self._participants:
            if commit:
                participant.on_commit()
            else:
                participant.on_abort()
        return commit
