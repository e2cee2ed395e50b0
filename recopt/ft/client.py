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

from recopt.ft.auth import AuthError, Verifier, sign

# The context a request's signature covers; a reply's covers the request's nonce instead.
LIGHTHOUSE_CONTEXT = "lighthouse"


def envelope(secret: bytes | None, context: str, message: dict[str, Any]) -> bytes:
    """One signed protocol line: the JSON message as text, with its signature fields."""
    body = json.dumps(message)
    return (json.dumps({"body": body, **sign(secret, context, body.encode())}) + "\n").encode()


def open_envelope(
    line: bytes, verifier: Verifier, context: str
) -> tuple[dict[str, Any], str | None]:
    """Check and decode a line made by `envelope`; returns the message and its nonce.

    Raises:
        AuthError: the signature is missing, wrong, stale or replayed.
        ValueError: the line is not an envelope.
    """
    outer = json.loads(line)
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), str):
        raise ValueError("not a recopt fault-tolerance message")
    body: str = outer["body"]
    nonce = verifier.verify(outer, context, body.encode())
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("not a recopt fault-tolerance message")
    return message, nonce


class LighthouseError(ConnectionError):
    """The lighthouse answered with an error; ``reply`` is its whole answer."""

    def __init__(self, message: str, reply: dict[str, Any]) -> None:
        super().__init__(message)
        self.reply = reply


def request(
    address: tuple[str, int],
    payload: dict[str, Any],
    timeout: datetime.timedelta,
    secret: bytes | None = None,
) -> dict[str, Any]:
    """Send one request to a lighthouse and return its reply.

    Args:
        address: the lighthouse's (host, port).
        payload: the JSON request; ``timeout_s`` is added so the server stops waiting too.
        timeout: limit for the connection and the reply.
        secret: the shared secret signing the request and checking the reply.

    Returns:
        The decoded reply.

    Raises:
        TimeoutError: the lighthouse did not answer in time, or reported a timeout.
        ConnectionError: it could not be reached, refused this client (no or wrong
            secret), sent a reply that fails authentication, or reported another error.
    """
    seconds = timeout.total_seconds()
    message = {**payload, "timeout_s": seconds}
    line_out = envelope(secret, LIGHTHOUSE_CONTEXT, message)
    sent_nonce = json.loads(line_out).get("nonce", "")
    try:
        with socket.create_connection(address, timeout=min(seconds, 10.0)) as sock:
            # The server answers by its own deadline; the margin covers the network.
            sock.settimeout(seconds + 5.0)
            sock.sendall(line_out)
            line = sock.makefile("rb").readline()
    except TimeoutError:
        raise
    except OSError as exc:
        raise ConnectionError(f"lighthouse {address[0]}:{address[1]} unreachable: {exc}") from exc
    if not line:
        raise ConnectionError(f"lighthouse {address[0]}:{address[1]} closed the connection")
    try:
        reply, _ = open_envelope(line, Verifier(secret), f"reply {sent_nonce}")
    except (AuthError, ValueError) as exc:
        raise ConnectionError(
            f"lighthouse {address[0]}:{address[1]}: reply refused ({exc}); is this the "
            "lighthouse of this job, with the same shared secret?"
        ) from exc
    error = reply.get("error")
    if error is not None:
        if str(error).startswith("TimeoutError"):
            raise TimeoutError(f"lighthouse: {error}")
        raise LighthouseError(f"lighthouse: {error}", reply)
    return reply


def wait_for_replicas(
    address: tuple[str, int],
    count: int,
    timeout: datetime.timedelta,
    secret: bytes | None = None,
) -> list[str]:
    """Block until the lighthouse hears at least ``count`` live replica groups.

    Useful before the first step, so that replicas that start a little apart still form their
    first quorum together rather than the first one training alone.

    Args:
        address: the lighthouse's (host, port).
        count: number of live replica groups to wait for.
        timeout: limit for the whole wait.
        secret: the shared secret (see `request`).

    Returns:
        The live replica ids.

    Raises:
        TimeoutError: fewer than ``count`` were live when the timeout ran out.
        ConnectionError: the lighthouse refused this client, or failed authentication.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    live: list[str] = []
    while time.monotonic() < deadline:
        try:
            reply = request(address, {"op": "status"}, datetime.timedelta(seconds=5), secret)
            live = list(reply["live"])
        except ConnectionError as exc:
            if "AuthError" in str(exc) or "reply refused" in str(exc):
                raise  # a wrong or missing secret does not fix itself by waiting
            live = []  # the lighthouse may still be starting
        if len(live) >= count:
            return live
        time.sleep(0.05)
    raise TimeoutError(f"only {len(live)} of {count} replica groups live after {timeout}: {live}")
