"""Healing: who recovers from whom, and the HTTP transport of the state a replica heals from.

A replica that joins a quorum behind the others (restarted, or it missed committed steps)
receives the model and optimizer state of a peer at the quorum's newest step. Each healthy
replica serves a snapshot, taken at quorum time, from a small threaded HTTP server. Sharded
state travels as each rank's local shards (`to_local_shards` / `into_local_shards`): rank r
of a group heals from rank r of its source group, which holds the same shards. Requests and
responses are signed with the job's secret; a healer refuses a state whose SHA-256 differs
from the one the source announced, or that holds NaN or inf.
"""

from __future__ import annotations

import datetime
import hmac
import http.server
import io
import socketserver
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.ft.auth import AuthError, Verifier, digest, sign

# Marks a ShardedTensor's local shards in a transferred state (plain tensors, weights_only).
LOCAL_SHARDS = "__recopt_local_shards__"

# How long a healing replica waits between attempts while its source has not yet published.
_RETRY_S = 0.05
# Signature fields as HTTP headers (request: over the path; response: over the digest).
_HEADER = {"ts": "X-Recopt-Ts", "nonce": "X-Recopt-Nonce", "mac": "X-Recopt-Mac"}
_DIGEST = "X-Recopt-Sha256"


class HealingRefused(ValueError):
    """A healing state that must not be loaded: altered in transit, or not finite."""


def plan_recovery(members: list[dict[str, Any]], init_sync: bool) -> dict[str, str]:
    """Assign each replica that must heal the peer it heals from.

    Replicas behind the quorum's newest step heal from one at that step (spread round-robin
    over the up-to-date ones). With ``init_sync``, at step 0 a replica on its first quorum
    heals from the first up-to-date member, so that replicas start from identical weights
    whatever their seeds.

    Args:
        members: the quorum's members, each with ``replica_id``, ``step`` and ``first``.
        init_sync: synchronise fresh replicas at step 0.

    Returns:
        healer replica id -> source replica id.
    """
    max_step = max(int(m["step"]) for m in members)
    sources = [str(m["replica_id"]) for m in members if int(m["step"]) == max_step]
    if max_step > 0:
        healers = [str(m["replica_id"]) for m in members if int(m["step"]) < max_step]
    elif init_sync:
        healers = [str(m["replica_id"]) for m in members if m.get("first")]
        healers = [h for h in healers if h != sources[0]]
        sources = sources[:1]
    else:
        healers = []
    return {h: sources[i % len(sources)] for i, h in enumerate(healers)}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: CheckpointServer

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        fields = {k: self.headers.get(h, "") for k, h in _HEADER.items()}
        try:
            nonce = self.server.verifier.verify(fields, f"GET {self.path}", b"")
        except AuthError as exc:
            self.send_error(403, f"refused: {exc}")
            return
        found = self.server.get(self.path)
        if found is None:
            self.send_error(404, "no checkpoint for this step yet")
            return
        payload, sha = found
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header(_DIGEST, sha)
        for key, value in sign(self.server.verifier.secret, f"reply {nonce}", sha.encode()).items():
            self.send_header(_HEADER[key], value)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass  # one line per request on stderr would drown the training logs


class CheckpointServer(http.server.ThreadingHTTPServer):
    """Serves the latest published state at ``/checkpoint/<step>`` (one step kept).

    Args:
        host: interface to listen on; the port is chosen free (read ``port``).
        timeout: socket timeout for a client connection.
        secret: the job's shared secret: requests must be signed with it, and responses
            are. None: anyone who reaches the port may download the state.
    """

    daemon_threads = True

    def __init__(self, host: str, timeout: datetime.timedelta, secret: bytes | None = None) -> None:
        self.verifier = Verifier(secret)
        super().__init__((host, 0), _Handler)
        self.timeout = timeout.total_seconds()
        self._lock = threading.Lock()
        self._step: int | None = None
        self._payload = b""
        self._digest = ""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def server_bind(self) -> None:
        # HTTPServer's own version resolves the host's FQDN, a reverse DNS lookup that can
        # take seconds; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.port

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self.server_address[1])

    def publish(self, step: int, state: dict[str, Any]) -> int:
        """Snapshot ``state`` (serialised now, so later updates do not leak in); returns bytes."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        with self._lock:
            self._step, self._payload, self._digest = step, payload, digest(payload)
            return len(self._payload)

    def get(self, path: str) -> tuple[bytes, str] | None:
        """The payload served at ``path`` and its SHA-256, or None if it is not the
        published step."""
        with self._lock:
            if self._step is not None and path == f"/checkpoint/{self._step}":
                return self._payload, self._digest
        return None

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self.shutdown()
        self.server_close()


def fetch_checkpoint(
    url: str, timeout: datetime.timedelta, secret: bytes | None = None
) -> dict[str, Any]:
    """Download and decode a published state, retrying until the source has published it.

    Args:
        url: ``http://host:port/checkpoint/<step>``.
        timeout: limit for the whole download, retries included.
        secret: the job's shared secret (signs the request, checks the response).

    Returns:
        The state dict (tensors on CPU, loaded with ``weights_only=True``), every floating
        tensor finite.

    Raises:
        TimeoutError: the source did not serve the state in time.
        AuthError: the source refused this replica's signature, or its response fails
            authentication.
        HealingRefused: the payload's SHA-256 differs from the announced one, or the state
            holds NaN or inf.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last_error: Exception | None = None
    path = urllib.parse.urlsplit(url).path
    while time.monotonic() < deadline:
        remaining = max(0.1, deadline - time.monotonic())
        fields = sign(secret, f"GET {path}", b"")
        headers = {_HEADER[k]: v for k, v in fields.items()}
        try:
            req = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(req, timeout=remaining) as response:
                data = response.read()
                answer = {k: response.headers.get(h, "") for k, h in _HEADER.items()}
                announced = response.headers.get(_DIGEST, "")
            return _checked_state(data, announced, answer, secret, fields.get("nonce"), url)
        except urllib.error.HTTPError as exc:
            if exc.code == 403:
                raise AuthError(f"{url} refused this replica: {exc.reason}") from exc
            last_error = exc  # 404 until the source has published
            time.sleep(_RETRY_S)
        except (urllib.error.URLError, OSError) as exc:
            # 404 until the source has published; connection refused while it starts up.
            last_error = exc
            time.sleep(_RETRY_S)
    raise TimeoutError(f"no checkpoint from {url} within {timeout}: last error {last_error}")


def _checked_state(
    data: bytes,
    announced: str,
    answer: dict[str, str],
    secret: bytes | None,
    nonce: str | None,
    url: str,
) -> dict[str, Any]:
    """Decode a downloaded state once its digest, signature and values check out."""
    actual = digest(data)
    if not hmac.compare_digest(actual, announced):
        raise HealingRefused(
            f"refusing to heal from {url}: the state's SHA-256 is {actual[:16]}..., the "
            f"source announced {announced[:16] or 'none'}...; it was altered in transit"
        )
    Verifier(secret).verify(answer, f"reply {nonce}", announced.encode())
    state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    bad = nonfinite_paths(state)
    if bad:
        raise HealingRefused(
            f"refusing to heal from {url}: NaN or inf in {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; the source replica has diverged"
        )
    return state


def nonfinite_paths(value: Any, path: str = "") -> list[str]:
    """Paths (``a/b/0``) of the floating-point tensors in ``value`` that hold NaN or inf."""
    if isinstance(value, torch.Tensor):
        floating = value.is_floating_point() or value.is_complex()
        return [path or "."] if floating and not bool(torch.isfinite(value).all()) else []
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        found += nonfinite_paths(item, f"{path}/{key}" if path else str(key))
    return found


def to_local_shards(value: Any) -> Any:
    """``value`` with every ShardedTensor replaced by its local shards' plain tensors.

    The result loads with ``torch.load(weights_only=True)``; `into_local_shards` puts it back.
    """
    if isinstance(value, ShardedTensor):
        return {LOCAL_SHARDS: [shard.tensor for shard in value.local_shards()]}
    if isinstance(value, dict):
        return {k: to_local_shards(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_local_shards(v) for v in value)
    return value


@torch.no_grad()
def into_local_shards(received: Any, current: Any) -> Any:
    """Copy the local shards in ``received`` into the ShardedTensors of ``current``.

    Args:
        received: a state from `to_local_shards` (of the same rank of a group with the same
            sharding plan).
        current: this rank's own state of the same structure (e.g. ``model.state_dict()``),
            whose ShardedTensors are views of the live shards.

    Returns:
        ``received`` with each local-shard entry replaced by the (now updated) ShardedTensor
        of ``current``, ready for ``load_state_dict``.

    Raises:
        ValueError: the local shards differ in number or shape (not the same plan or rank).
    """
    if isinstance(received, dict) and LOCAL_SHARDS in received:
        if not isinstance(current, ShardedTensor):
            raise ValueError(
                "healing state holds local shards where this rank's state has no ShardedTensor; "
                "every replica group must use the same sharding plan"
            )
        mine = [shard.tensor for shard in current.local_shards()]
        theirs = received[LOCAL_SHARDS]
        if [t.shape for t in mine] != [t.shape for t in theirs]:
            raise ValueError(
                f"healing source's local shards {[tuple(t.shape) for t in theirs]} differ from "
                f"this rank's {[tuple(t.shape) for t in mine]}; every replica group must use "
                "the same sharding plan and group size"
            )
        for dst, src in zip(mine, theirs, strict=True):
            dst.copy_(src)
        return current
    if isinstance(received, dict):
        mapping: dict[Any, Any] = current if isinstance(current, dict) else {}
        return {k: into_local_shards(v, mapping.get(k)) for k, v in received.items()}
    if isinstance(received, list | tuple):
        same = isinstance(current, list | tuple) and len(current) == len(received)
        peers: Sequence[Any] = current if same else [None] * len(received)
        return type(received)(into_local_shards(v, c) for v, c in zip(received, peers, strict=True))
    return received
