"""A torchft `CheckpointTransport` that carries tensors and plain values only, never pickles.

torchft's own transports unpickle what a peer sends (``HTTPTransport`` loads with
``weights_only=False``, ``PGTransport`` calls ``pickle.loads``), so any process that can reach
a healing replica could run code in it. `TensorTransport` encodes a state as a JSON skeleton
(dicts with str/int keys, lists, tuples, None/bool/int/float/str) plus raw tensor bytes of a
fixed list of dtypes, serves it over HTTP with its SHA-256, and the healer checks the digest
and that every floating tensor is finite before anything is decoded into the live state.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.server
import json
import socketserver
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from recopt.ft.healing_state import HealingRefused, nonfinite_paths

_MAGIC = b"RCFT1"
_DIGEST_HEADER = "X-Recopt-Sha256"
_RETRY_S = 0.05
_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def encode_state(state: Any) -> bytes:
    """``state`` as bytes: magic, header length, JSON header, then the tensors' raw bytes.

    Raises:
        TypeError: a value that is not a tensor, container or plain value (its path named).
    """
    chunks: list[bytes] = []
    metas: list[list[Any]] = []
    offset = 0

    def visit(value: Any, path: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            if str(value.dtype) not in _DTYPES:
                raise TypeError(f"healing state {path}: dtype {value.dtype} is not supported")
            plain = value.detach().cpu().contiguous().reshape(-1)
            data = plain.view(torch.uint8).numpy().tobytes() if plain.numel() else b""
            metas.append([str(value.dtype), list(value.shape), offset, len(data)])
            chunks.append(data)
            offset += len(data)
            return {"t": len(metas) - 1}
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise TypeError(f"healing state {path}: key {key!r} is not a str or int")
                items.append([key, visit(item, f"{path}/{key}")])
            return {"d": items}
        if isinstance(value, list | tuple):
            kind = "l" if isinstance(value, list) else "u"
            return {kind: [visit(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"v": value}
        raise TypeError(
            f"healing state {path or '.'}: {type(value).__name__} is neither a tensor, a "
            "container nor a plain value; give the state_dict plain values"
        )

    tree = visit(state, "")
    header = json.dumps({"tree": tree, "tensors": metas}).encode()
    return _MAGIC + struct.pack("<Q", len(header)) + header + b"".join(chunks)


def decode_state(data: bytes) -> Any:
    """The state `encode_state` wrote (tensors on the CPU, owning their memory).

    Raises:
        HealingRefused: not such a payload, or a tensor outside it.
    """
    start = len(_MAGIC) + 8
    if len(data) < start or not data.startswith(_MAGIC):
        raise HealingRefused("healing payload is not a recopt tensor state")
    (length,) = struct.unpack("<Q", data[len(_MAGIC) : start])
    try:
        header = json.loads(data[start : start + length])
    except ValueError as exc:
        raise HealingRefused(f"healing payload header is not JSON: {exc}") from exc
    body = memoryview(data)[start + length :]
    tensors = [_tensor(body, meta) for meta in header["tensors"]]

    def build(node: dict[str, Any]) -> Any:
        if "t" in node:
            return tensors[int(node["t"])]
        if "d" in node:
            return {key: build(item) for key, item in node["d"]}
        if "l" in node:
            return [build(item) for item in node["l"]]
        if "u" in node:
            return tuple(build(item) for item in node["u"])
        return node["v"]

    return build(header["tree"])


def _tensor(body: memoryview, meta: list[Any]) -> torch.Tensor:
    dtype_name, shape, offset, size = meta
    dtype = _DTYPES.get(str(dtype_name))
    if dtype is None:
        raise HealingRefused(f"healing payload: dtype {dtype_name!r} is not allowed")
    numel = 1
    for n in shape:
        numel *= int(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if size != numel * itemsize or offset < 0 or offset + size > len(body):
        raise HealingRefused(f"healing payload: tensor {meta} lies outside the payload")
    if numel == 0:
        return torch.empty([int(n) for n in shape], dtype=dtype)
    raw = torch.frombuffer(bytearray(body[offset : offset + size]), dtype=torch.uint8)
    return raw.view(dtype).reshape([int(n) for n in shape])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # an idle connection is closed

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        found = self.server.transport.served(self.path)
        if found is None:
            self.send_error(404, "no checkpoint for this step")
            return
        payload, sha = found
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header(_DIGEST_HEADER, sha)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass  # one line per request would drown the training logs


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, transport: TensorTransport, timeout_s: float) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        super().__init__((host, 0), _Handler)

    def server_bind(self) -> None:
        # HTTPServer's version resolves the host's FQDN (a reverse lookup that may take seconds).
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]


class TensorTransport(CheckpointTransport[dict[str, Any]]):
    """torchft healing over HTTP with tensor-only payloads, checked before they are loaded.

    Args:
        timeout: limit of a download (retries included) and of an idle connection.
        bind_host: interface the server listens on (loopback by default).
        hostname: the name peers reach ``bind_host`` by (defaults to ``bind_host``).
    """

    def __init__(
        self, timeout: datetime.timedelta, bind_host: str = "127.0.0.1", hostname: str = ""
    ) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._path = ""
        self._payload = b""
        self._digest = ""
        self._server = _Server(bind_host, self, timeout.total_seconds())
        self._hostname = hostname or bind_host
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        """The URL peers heal from."""
        return f"http://{self._hostname}:{self._server.server_address[1]}"

    def send_checkpoint(
        self,
        dst_ranks: list[int],
        step: int,
        state_dict: dict[str, Any],
        timeout: datetime.timedelta,
    ) -> None:
        """Encode ``state_dict`` now (later updates do not leak in) and serve it for ``step``."""
        payload = encode_state(state_dict)
        with self._lock:
            self._path = f"/checkpoint/{step}"
            self._payload, self._digest = payload, hashlib.sha256(payload).hexdigest()

    def disallow_checkpoint(self) -> None:
        """Stop serving: the state is about to change."""
        with self._lock:
            self._path, self._payload, self._digest = "", b"", ""

    def served(self, path: str) -> tuple[bytes, str] | None:
        """The payload and SHA-256 served at ``path``, if it is the published step's."""
        with self._lock:
            if self._path and path == self._path:
                return self._payload, self._digest
        return None

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta
    ) -> dict[str, Any]:
        """Download ``step`` from ``metadata``, retrying until the source serves it.

        Raises:
            TimeoutError: the source did not serve it within the timeout.
            HealingRefused: the digest differs from the announced one, or a floating tensor
                holds NaN or inf (the source diverged).
        """
        url = f"{metadata}/checkpoint/{step}"
        limit = min(timeout, self._timeout)
        deadline = time.monotonic() + limit.total_seconds()
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                wait = max(0.1, deadline - time.monotonic())
                with urllib.request.urlopen(url, timeout=wait) as response:
                    data = response.read()
                    announced = response.headers.get(_DIGEST_HEADER, "")
                return _checked(data, announced, url)
            except (urllib.error.URLError, OSError) as exc:
                last = exc  # 404 until the source has published; refused while it starts
                time.sleep(_RETRY_S)
        raise TimeoutError(f"no checkpoint from {url} within {limit}: last error {last}")

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server and close its socket."""
        self._server.shutdown()
        self._server.server_close()


def _checked(data: bytes, announced: str, url: str) -> dict[str, Any]:
    actual = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(actual, announced):
        raise HealingRefused(
            f"refusing to heal from {url}: the state's SHA-256 is {actual[:16]}..., the source "
            f"announced {announced[:16] or 'none'}...; it was altered in transit"
        )
    state = decode_state(data)
    bad = nonfinite_paths(state)
    if bad:
        raise HealingRefused(
            f"refusing to heal from {url}: NaN or inf in {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; the source replica has diverged"
        )
    if not isinstance(state, dict):
        raise HealingRefused(f"refusing to heal from {url}: the state is not a dict")
    return state
