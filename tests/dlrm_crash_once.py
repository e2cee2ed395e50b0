"""The DLRM script under torchrun, with rank 1 SIGKILLing itself once (tests only).

On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 kills itself after step 3;
on the restart it starts ``late_s`` seconds after its peer, as a slow host would, which once
made it read its peer's address of the dead attempt from the reused store.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "dlrm"))

import train  # noqa: E402

KILL_AFTER_STEP = 3


def main() -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    late_s = float(os.environ.get("CRASH_ONCE_LATE_S", "3"))
    if attempt > 0 and rank == 1:
        time.sleep(late_s)
    if attempt == 0 and rank == 1:
        step_done = train.Trainer.step_done  # after each step, in the plain and pipelined loops

        def killing_step_done(self: train.Trainer, *args: Any) -> bool:
            committed = step_done(self, *args)
            if self.step + 1 >= KILL_AFTER_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            return committed

        train.Trainer.step_done = killing_step_done  # type: ignore[method-assign]
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
