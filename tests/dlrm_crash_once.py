"""The DLRM script under torchrun, with rank 1 SIGKILLing itself once (tests only).

On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 kills itself after step 3, saying
so on stderr first, and rank 0 then dawdles ``CRASH_ONCE_SLOW_PEER_S`` seconds before its next
collective, as a loaded host does: torchrun (which polls its workers every 0.1 s) then stops it
before it can notice its peer's death, so nothing of rank 0 may be relied on in that attempt. On
the restart rank 1 starts ``CRASH_ONCE_LATE_S`` seconds after its peer, as a slow host would,
which once made it read its peer's address of the dead attempt from the reused store.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "dlrm"))

import train  # noqa: E402

KILL_AFTER_STEP = 3
KILLED = "crash_once: rank 1 SIGKILLs itself after step"


def _after_kill_step(action: Callable[[train.Trainer], None]) -> None:
    """Run ``action(trainer)`` after the step that reaches `KILL_AFTER_STEP` (and later ones)."""
    step_done = train.Trainer.step_done  # after each step, in the plain and pipelined loops

    def patched(self: train.Trainer, *args: Any) -> bool:
        committed = step_done(self, *args)
        if self.step + 1 >= KILL_AFTER_STEP:
            action(self)
        return committed

    train.Trainer.step_done = patched  # type: ignore[method-assign]


def _kill(trainer: train.Trainer) -> None:
    sys.stderr.write(f"{KILLED} {trainer.step + 1}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    late_s = float(os.environ.get("CRASH_ONCE_LATE_S", "3"))
    slow_peer_s = float(os.environ.get("CRASH_ONCE_SLOW_PEER_S", "0"))
    if attempt > 0 and rank == 1:
        time.sleep(late_s)
    if attempt == 0 and rank == 1:
        _after_kill_step(_kill)
    if attempt == 0 and rank == 0 and slow_peer_s > 0:
        _after_kill_step(lambda _: time.sleep(slow_peer_s))
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
