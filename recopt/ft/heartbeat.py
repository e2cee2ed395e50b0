"""A replica's liveness with the lighthouse: registration, then a heartbeat in the background.

Kept apart from the Manager's step transaction (quorum, vote, commit): the heartbeat runs on
its own thread from construction to shutdown, whatever the steps do, and the lighthouse
drops a replica whose heartbeats stop.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING

from recopt.ft.client import LighthouseError, request

if TYPE_CHECKING:
    from recopt.ft.manager import ManagerConfig

logger = logging.getLogger(__name__)


class Heartbeat:
    """Registers one rank of a replica group with the lighthouse and keeps it alive.

    Args:
        config: the replica's identity, lighthouse address, interval and secret.
    """

    def __init__(self, config: ManagerConfig) -> None:
        self.config = config
        # Tells this process from another one that was given the same replica id.
        self.session = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        """Registers (see `register`), then heartbeats every interval until `stop`.

        Raises:
            ValueError: the replica id (and rank) belongs to another live process.
        """
        self.register()
        self._thread.start()

    def send(self) -> LighthouseError | None:
        """One heartbeat; returns the lighthouse's error, if it answered with one."""
        payload = {
            "op": "heartbeat",
            "replica_id": self.config.replica_id,
            "group_rank": self.config.group_rank,
            "session": self.session,
        }
        try:
            timeout = self.config.heartbeat_interval * 5
            request(self.config.lighthouse, payload, timeout, self.config.secret)
        except LighthouseError as exc:
            logger.warning("heartbeat refused: %s", exc)
            return exc
        except (OSError, ConnectionError) as exc:
            logger.debug("heartbeat failed: %s", exc)
        return None

    def register(self) -> None:
        """First heartbeat; refuses a replica id that another live process already uses.

        A restarted replica may find its dead predecessor not yet expired: it retries until
        the predecessor's heartbeat would have expired (the refusal says when), not longer.

        Raises:
            ValueError: the replica id (and rank) belongs to another live process.
        """
        deadline: float | None = None
        while True:
            error = self.send()
            if error is None or "expires_in_s" not in error.reply:
                return
            if deadline is None:
                wait = float(error.reply["expires_in_s"]) + 0.5
                deadline = time.monotonic() + wait
            if time.monotonic() >= deadline:
                raise ValueError(str(error).split("DuplicateReplicaError: ", 1)[-1])
            time.sleep(self.config.heartbeat_interval.total_seconds())

    def _loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval.total_seconds()):
            self.send()

    def stop(self) -> None:
        """Stops heartbeating (waits up to ten intervals for the thread to end)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.heartbeat_interval.total_seconds() * 10)
