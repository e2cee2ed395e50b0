"""Test harness: a lighthouse and replica workers as real processes, all killed at the end.

The lighthouse runs in the test process by default (one process start less per test: on a
loaded 2-core machine each start costs seconds); ``cli=True`` runs ``python -m
recopt.ft.lighthouse`` as a process instead, as a launch would.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recopt.ft.lighthouse import Lighthouse, LighthouseConfig

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ft_worker.py"


class Cluster:
    """Starts processes under ``out``; ``close()`` SIGKILLs whatever is still running."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []
        self.replicas: dict[str, subprocess.Popen[bytes]] = {}
        self.port = 0
        self.lighthouse: Lighthouse | None = None

    def _spawn(
        self, args: list[str], log_name: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        log = open(self.out / log_name, "ab")
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.procs.append(proc)
        return proc

    def start_lighthouse(
        self, min_replicas: int = 1, join_s: float = 1.0, hb_s: float = 1.0, cli: bool = False
    ) -> int:
        if not cli:
            config = LighthouseConfig(
                min_replicas=min_replicas,
                join_timeout=datetime.timedelta(seconds=join_s),
                heartbeat_timeout=datetime.timedelta(seconds=hb_s),
            )
            self.lighthouse = Lighthouse(config, host="127.0.0.1", port=0)
            self.lighthouse.start()
            self.port = self.lighthouse.port
            return self.port
        port_file = self.out / "lighthouse.port"
        self._spawn(
            [
                "-m",
                "recopt.ft.lighthouse",
                "--port=0",
                f"--min-replicas={min_replicas}",
                f"--join-timeout-s={join_s}",
                f"--heartbeat-timeout-s={hb_s}",
                f"--port-file={port_file}",
            ],
            "lighthouse.log",
        )
        wait_for(port_file.exists, 30, "lighthouse port file")
        self.port = int(port_file.read_text())
        return self.port

    def start_replica(
        self, replica_id: str, *extra: str, seed: int = 0, name: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a worker; ``name`` (default the replica id) keys its process and log."""
        name = name or replica_id
        proc = self._spawn(
            [
                str(WORKER),
                f"--replica-id={replica_id}",
                f"--rank-seed={seed}",
                f"--lighthouse-port={self.port}",
                f"--out={self.out}",
                *extra,
            ],
            f"{name}.log",
        )
        self.replicas[name] = proc
        return proc

    def start_script(self, name: str, script: Path, *args: str) -> subprocess.Popen[bytes]:
        """Run ``script`` with ``args``; ``name`` keys its process and log."""
        proc = self._spawn([str(script), *args], f"{name}.log")
        self.replicas[name] = proc
        return proc

    def start_dlrm(self, replica_id: str, *args: str) -> subprocess.Popen[bytes]:
        """Run examples/dlrm/train.py --fault-tolerant as replica group ``replica_id``."""
        env = {"RECOPT_FT_LIGHTHOUSE": f"127.0.0.1:{self.port}", "RECOPT_FT_REPLICA_ID": replica_id}
        script = str(ROOT / "examples" / "dlrm" / "train.py")
        proc = self._spawn([script, "--fault-tolerant", *args], f"{replica_id}.log", env)
        self.replicas[replica_id] = proc
        return proc

    def kill(self, replica_id: str) -> None:
        proc = self.replicas[replica_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def entries(self, replica_id: str) -> list[dict[str, Any]]:
        path = self.out / f"{replica_id}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def state(self, replica_id: str, step: int) -> dict[str, Any]:
        loaded: dict[str, Any] = torch.load(
            self.out / replica_id / f"step{step}.pt", weights_only=True
        )
        return loaded

    def steps_saved(self, replica_id: str) -> set[int]:
        folder = self.out / replica_id
        return {int(p.stem[4:]) for p in folder.glob("step*.pt")} if folder.exists() else set()

    def stop(self, timeout_s: float = 30) -> None:
        """Ask the replicas to finish and wait for them."""
        (self.out / "stop").write_text("")
        deadline = time.monotonic() + timeout_s
        for proc in self.replicas.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def run_fused_replicas(self, *extra_for_a: str, steps: int | None = None) -> None:
        """Runs `FUSED_WORKER` as replicas a and b (seeds 1, 2) under a fresh lighthouse, until
        both exit 0; ``extra_for_a`` are more flags for replica a only."""
        port = self.start_lighthouse(min_replicas=2, join_s=1.0, hb_s=2.0)
        length = [] if steps is None else [f"--steps={steps}"]
        procs = [
            self._spawn(
                [
                    str(FUSED_WORKER),
                    f"--replica-id={name}",
                    f"--rank-seed={seed}",
                    f"--lighthouse-port={port}",
                    f"--out={self.out}",
                    *length,
                    *(extra_for_a if name == "a" else ()),
                ],
                f"{name}.log",
            )
            for name, seed in (("a", 1), ("b", 2))
        ]
        for proc in procs:
            assert proc.wait(timeout=90) == 0, self.logs()

    def close(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in self.out.glob("*.log"))


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-for-bit equality of two nested state dicts."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b, (a, b)


FUSED_WORKER = Path(__file__).resolve().parent / "ft_fused_worker.py"
