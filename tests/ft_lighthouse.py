"""torchft's lighthouse for the fault-tolerance tests: in this process, or its binary.

`in_process` serves from a thread of the test process (cheap); `start_process` runs the
``torchft_lighthouse`` command a job runs, so that a test can kill and restart it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def in_process(min_replicas: int, join_timeout_ms: int = 200) -> Any:
    """A `torchft.coordination.LighthouseServer` on a free port (heartbeats expire in 1 s)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=1000,
    )


def address(server: Any) -> str:
    """The URL replica groups reach an in-process lighthouse at."""
    port = int(server.address().rsplit(":", 1)[1])
    return f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_process(port: int, min_replicas: int) -> subprocess.Popen[bytes]:
    """torchft's lighthouse binary on ``port``, returned once the port accepts."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    command = [str(binary), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas)]
    command += ["--join_timeout_ms", "200", "--heartbeat_timeout_ms", "1000"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise TimeoutError(f"torchft_lighthouse did not listen on port {port} within 30 s")
