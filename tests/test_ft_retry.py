"""StepRetrier: a dropped step retries its batch, with back-off, and stops when it must."""

from __future__ import annotations

import pytest

from recopt.ft.healing_state import HealingRefused
from recopt.ft.nonfinite import NonFiniteGradientError
from recopt.ft.retry import RetryPolicy, StepFailuresError, StepRetrier, is_permanent


class _Manager:
    """The one thing StepRetrier reads from a manager: the step's error."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error


def _retrier(**policy: float) -> tuple[StepRetrier, _Manager, list[float]]:
    manager, waits = _Manager(), []
    retrier = StepRetrier(manager, RetryPolicy(**policy), sleep=waits.append)  # type: ignore[arg-type]
    return retrier, manager, waits


def test_a_dropped_step_keeps_its_batch_until_it_commits() -> None:
    retrier, manager, waits = _retrier(backoff_s=0.1, max_backoff_s=0.3)
    manager.error = TimeoutError("lighthouse unreachable")
    # A loop over 3 batches where positions 1 fails four times: every batch trains once.
    position, trained = 0, []
    outcomes = iter([True, False, False, False, False, True, True])
    while position < 3:
        committed = next(outcomes)
        if committed:
            trained.append(position)
        if retrier.after_step(committed):
            position += 1
    assert trained == [0, 1, 2]
    assert waits == [0.1, 0.2, 0.3, 0.3]  # doubling, capped
    assert retrier.retried_steps == 4 and retrier.consecutive_failures == 0


def test_consecutive_failures_stop_with_the_cause() -> None:
    retrier, manager, _ = _retrier(max_consecutive_failures=3, backoff_s=0.0)
    manager.error = ConnectionError("peer 10.0.0.2 reset the connection")
    assert retrier.after_step(False) is False
    assert retrier.after_step(False) is False
    with pytest.raises(StepFailuresError, match="3 consecutive.*peer 10.0.0.2 reset"):
        retrier.after_step(False)


def test_a_commit_resets_the_count() -> None:
    retrier, manager, _ = _retrier(max_consecutive_failures=2, backoff_s=0.0)
    manager.error = TimeoutError("slow")
    for _ in range(5):
        assert retrier.after_step(False) is False
        assert retrier.after_step(True) is True


@pytest.mark.parametrize(
    "error",
    [
        ValueError("min_replica_size=0 must be at least 1"),
        ImportError("fault tolerance runs on torchft, which is not installed"),
    ],
    ids=["configuration", "missing-extra"],
)
def test_errors_that_cannot_heal_stop_at_once(error: Exception) -> None:
    retrier, manager, waits = _retrier()
    manager.error = error
    with pytest.raises(StepFailuresError, match="retrying cannot heal") as info:
        retrier.after_step(False)
    assert info.value.__cause__ is error and waits == []


def test_a_nonfinite_step_moves_on_and_a_refused_heal_is_retried() -> None:
    retrier, manager, waits = _retrier(backoff_s=0.5)
    manager.error = NonFiniteGradientError("NaN in table t0")
    assert retrier.after_step(False) is True and waits == []
    assert retrier.skipped_nonfinite == 1
    manager.error = HealingRefused("digest mismatch")
    assert not is_permanent(manager.error)
    assert retrier.after_step(False) is False and waits == [0.5]


def test_policy_names_a_bad_field() -> None:
    with pytest.raises(ValueError, match="max_consecutive_failures=0"):
        RetryPolicy(max_consecutive_failures=0)
    with pytest.raises(ValueError, match="backoff_s=-1"):
        RetryPolicy(backoff_s=-1)
