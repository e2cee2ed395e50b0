"""Message authentication for the fault-tolerance network: HMAC-SHA256 with a shared secret.

Every lighthouse request and reply, and every healing download, carries a timestamp, a random
nonce and an HMAC over both and the message, so a client without the secret is refused, a
tampered message fails its check, and a recorded message cannot be replayed. The secret comes
from the launcher (`read_secret`: a file or an environment variable read by the entry point).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# Messages older or newer than this (clock skew included) are refused.
MAX_AGE_S = 60.0
ENV_SECRET = "RECOPT_FT_SECRET"  # the shared secret itself
ENV_SECRET_FILE = "RECOPT_FT_SECRET_FILE"  # or a file holding it
LOOPBACK = "127.0.0.1"


class AuthError(Exception):
    """A message without a valid signature: no or wrong secret, tampered, stale or replayed."""


def read_secret(environ: Mapping[str, str]) -> bytes | None:
    """The shared secret from ``RECOPT_FT_SECRET`` or the file named by
    ``RECOPT_FT_SECRET_FILE`` (surrounding whitespace stripped); None if neither is set.

    Args:
        environ: the entry point's ``os.environ``.

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than 16 bytes.
    """
    secret: bytes | None = None
    if environ.get(ENV_SECRET):
        secret = environ[ENV_SECRET].strip().encode()
    elif environ.get(ENV_SECRET_FILE):
        try:
            secret = Path(environ[ENV_SECRET_FILE]).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{ENV_SECRET_FILE}={environ[ENV_SECRET_FILE]!r}: {exc}") from exc
    if secret is not None and len(secret) < 16:
        raise ValueError(
            f"the fault-tolerance secret ({ENV_SECRET} or {ENV_SECRET_FILE}) has {len(secret)} "
            "bytes; use at least 16 random bytes, e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`"
        )
    return secret


def check_bind(host: str, secret: bytes | None, what: str) -> None:
    """Refuse to serve beyond this host without a secret.

    Raises:
        ValueError: ``host`` is not a loopback address and ``secret`` is None.
    """
    if secret is None and not (host.startswith("127.") or host in ("localhost", "::1")):
        raise ValueError(
            f"{what} would listen on {host!r} without a shared secret: anyone who can reach "
            f"it could join the quorum and read or poison the model; set {ENV_SECRET} or "
            f"{ENV_SECRET_FILE} (the same on every replica and the lighthouse), or bind "
            f"{LOOPBACK}"
        )


def _mac(secret: bytes, timestamp: str, nonce: str, context: str, body: bytes) -> str:
    message = b"\n".join([timestamp.encode(), nonce.encode(), context.encode(), body])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes | None, context: str, body: bytes) -> dict[str, str]:
    """The fields that authenticate ``body`` in ``context`` (``{}`` without a secret).

    Args:
        secret: the shared secret, or None (no authentication).
        context: what the message is for (``"lighthouse"``, ``"GET /checkpoint/3"``, or a
            reply's request nonce), so a signature cannot be moved to another message.
        body: the message bytes.
    """
    if secret is None:
        return {}
    timestamp, nonce = f"{time.time():.6f}", secrets.token_hex(16)
    return {"ts": timestamp, "nonce": nonce, "mac": _mac(secret, timestamp, nonce, context, body)}


class Verifier:
    """Checks signatures made by `sign`, remembering recent nonces to refuse replays.

    Args:
        secret: the shared secret; None accepts every message (no authentication).
    """

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def verify(self, fields: Mapping[str, str], context: str, body: bytes) -> str | None:
        """Check ``fields`` for ``body`` in ``context``; returns the message's nonce.

        Raises:
            AuthError: missing, wrong, stale or replayed signature.
        """
        if self.secret is None:
            return None
        timestamp, nonce, mac = (str(fields.get(k, "")) for k in ("ts", "nonce", "mac"))
        if not (timestamp and nonce and mac):
            raise AuthError("unauthenticated message: this service requires the shared secret")
        expected = _mac(self.secret, timestamp, nonce, context, body)
        if not hmac.compare_digest(expected, mac):
            raise AuthError("bad signature: wrong shared secret, or the message was altered")
        try:
            age = abs(time.time() - float(timestamp))
        except ValueError:
            raise AuthError(f"bad timestamp {timestamp[:32]!r}") from None
        if age > MAX_AGE_S:
            raise AuthError(f"stale message ({age:.0f} s old; clocks must agree within 60 s)")
        with self._lock:
            now = time.monotonic()
            if nonce in self._seen:
                raise AuthError("replayed message (its nonce was seen before)")
            self._seen[nonce] = now
            if len(self._seen) > 4096:
                # Older than the age limit: a replay of it is refused as stale anyway.
                self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_AGE_S}
        return nonce


def digest(data: bytes) -> str:
    """SHA-256 of a payload, hex."""
    return hashlib.sha256(data).hexdigest()
