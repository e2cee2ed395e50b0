"""Client side of the lighthouse protocol: one JSON request, one JSON reply, per connection.

Kept apart from the server so that importing `recopt.ft` does not import the lighthouse
module that ``python -m recopt.ft.lighthouse`` runs as ``__main__``.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from typing import Any


def request(
    address: tuple[str, int], payload: dict[str, Any], timeout: datetime.timedelta
) -> dict[str, Any]:
    """Send one request to a lighthouse and return its reply.

    Args:
        address: the lighthouse's (host, port).
        payload: the JSON request; ``timeout_s`` is added so the server stops waiting too.
        timeout: limit for the connection and the reply.

    Returns:
        The decoded reply.

    Raises:
        TimeoutError: the lighthouse did not answer in time, or reported a timeout.
        ConnectionError: it could not be reached, or reported another error.
    """
    seconds = timeout.total_seconds()
    body = json.dumps({**payload, "timeout_s": seconds}) + "\n"
    try:
        with socket.create_connection(address, timeout=min(seconds, 10.0)) as sock:
            # The server answers by its own deadline; the margin covers the network.
            sock.settimeout(seconds + 5.0)
            sock.sendall(body.encode())
            line = sock.makefile("rb").readline()
    except TimeoutError:
        raise
    except OSError as exc:
        raise ConnectionError(f"lighthouse {address[0]}:{address[1]} unreachable: {exc}") from exc
    if not line:
        raise ConnectionError(f"lighthouse {address[0]}:{address[1]} closed the connection")
    reply: dict[str, Any] = json.loads(line)
    error = reply.get("error")
    if error is not None:
        if str(error).startswith("TimeoutError"):
            raise TimeoutError(f"lighthouse: {error}")
        raise ConnectionError(f"lighthouse: {error}")
    return reply


def wait_for_replicas(
    address: tuple[str, int], count: int, timeout: datetime.timedelta
) -> list[str]:
    """Block until the lighthouse hears at least ``count`` live replica groups.

    Useful before the first step, so that replicas that start a little apart still form their
    first quorum together rather than the first one training alone.

    Args:
        address: the lighthouse's (host, port).
        count: number of live replica groups to wait for.
        timeout: limit for the whole wait.

    Returns:
        The live replica ids.

    Raises:
        TimeoutError: fewer than ``count`` were live when the timeout ran out.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    live: list[str] = []
    while time.monotonic() < deadline:
        try:
            live = list(request(address, {"op": "status"}, datetime.timedelta(seconds=5))["live"])
        except ConnectionError:
            live = []  # the lighthouse may still be starting
        if len(live) >= count:
            return live
        time.sleep(0.05)
    raise TimeoutError(f"only {len(live)} of {count} replica groups live after {timeout}: {live}")
