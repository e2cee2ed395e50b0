"""What a training loop does after a fault-tolerant step: advance the data, retry, or stop.

A step that was dropped (a peer died, the lighthouse restarted, a collective timed out) did
not train its batch: the loop must retry the same batch at the next quorum, or a run with
outages silently skips data. `StepRetrier.after_step` says whether to advance the data
position; it backs off between consecutive failed steps, stops after
``RetryPolicy.max_consecutive_failures`` of them with the last cause, and stops at once on
errors that retrying cannot heal (configuration, a refused join).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from recopt.ft.healing_state import HealingRefused
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.steps import StepTransaction

logger = logging.getLogger(__name__)


class StepFailuresError(RuntimeError):
    """Fault-tolerant training stopped: steps kept failing, or failed for good."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How long a replica group keeps retrying steps that do not commit.

    Args:
        max_consecutive_failures: stop after this many dropped steps in a row.
        backoff_s: wait after the first dropped step; doubles with each further one.
        max_backoff_s: the longest wait between two attempts.
    """

    max_consecutive_failures: int = 50
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures={self.max_consecutive_failures} must be >= 1"
            )
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be finite and >= 0")


def is_permanent(error: BaseException | None) -> bool:
    """Whether retrying the step cannot help: a configuration error or a refused join.

    A healing state that failed its checks (`HealingRefused`) is retried: the next quorum
    may heal from another peer.
    """
    if error is None or isinstance(error, HealingRefused):
        return False
    return isinstance(error, ValueError | TypeError | ImportError)


class StepRetrier:
    """Decides, after each ``optimizer.step()``, whether the loop moves to the next batch.

    Args:
        manager: the replica group's manager (its ``errored()`` names the cause).
        policy: limits and back-off.
        sleep: waits between attempts (tests pass a recorder).
    """

    def __init__(
        self,
        manager: StepTransaction,
        policy: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._manager = manager
        self.policy = policy or RetryPolicy()
        self._sleep = sleep
        self.consecutive_failures = 0
        self.retried_steps = 0
        self.skipped_nonfinite = 0

    def after_step(self, committed: bool) -> bool:
        """True: the batch was trained (or must be skipped); False: retry the same batch.

        A step dropped for a NaN/inf gradient moves on: its batch would fail again.

        Raises:
            StepFailuresError: the error cannot heal by retrying, or
                ``max_consecutive_failures`` steps in a row did not commit.
        """
        if committed:
            self.consecutive_failures = 0
            return True
        error = self._manager.errored()
        if isinstance(error, NonFiniteGradientError):
            self.skipped_nonfinite += 1
            return True
        if is_permanent(error):
            raise StepFailuresError(
                f"fault-tolerant step failed with an error retrying cannot heal: "
                f"{type(error).__name__}: {error}"
            ) from error
        self.consecutive_failures += 1
        self.retried_steps += 1
        if self.consecutive_failures >= self.policy.max_consecutive_failures:
            raise StepFailuresError(
                f"{self.consecutive_failures} consecutive fault-tolerant steps did not commit "
                f"(RetryPolicy.max_consecutive_failures={self.policy.max_consecutive_failures}); "
                f"last cause: {type(error).__name__ if error else 'no quorum agreement'}: "
                f"{error or 'fewer replica groups than min_replica_size, or a peer voted no'}"
            ) from error
        wait = self.policy.backoff_s * 2 ** (self.consecutive_failures - 1)
        self._sleep(min(wait, self.policy.max_backoff_s))
        return False
