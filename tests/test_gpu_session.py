"""benchmarks/gpu_session.sh's CPU-side parts: the size check run before any device call, and a
step's leftover processes (ranks of a test cut off by its time limit) killed when it ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
MIB = 2**20

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not sys.platform.startswith("linux"),
    reason="the script runs on the Linux GPU hosts, with git",
)


def _bash(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(cwd / "out")}
    return subprocess.run(
        ["bash", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _sized(path: Path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(int(mib * MIB))


def test_check_counts_the_checkout_and_gpu_against_64_mib(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    _sized(tmp_path / ".gpu" / "fbgemm.tar.xz", 40)  # ignored by git, but carried
    _sized(tmp_path / "ignored" / "big", 100)  # neither
    _sized(tmp_path / "untracked.bin", 20)  # not ignored: the tool carries it
    ok = _bash(f"bash {SCRIPT} check", tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checkout + .gpu: 60 MiB of the 64 MiB" in ok.stdout
    _sized(tmp_path / "untracked.bin", 30)
    over = _bash(f"bash {SCRIPT} check", tmp_path)
    assert over.returncode == 1 and "too large by" in over.stdout
    assert not (tmp_path / "out").exists()  # the check writes nothing into the checkout


def test_a_step_leaves_no_process_behind(tmp_path: Path) -> None:
    # The step starts a process that would outlive it (as a rank of a timed-out test would).
    step = f"sleep 300 & echo $! > {tmp_path}/left; exit 3"
    done = _bash(f"source {SCRIPT}; limited 60 bash -c '{step}'; echo rc=$?", tmp_path)
    assert "rc=3" in done.stdout, done.stdout + done.stderr
    assert "killing what the step left running" in done.stdout
    pid = int((tmp_path / "left").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}").exists() else ""
        if "\nState:\tZ" in status:
            break
        time.sleep(0.1)
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text()


def test_a_step_cut_off_by_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    done = _bash(f"source {SCRIPT}; limited 11 sleep 100; echo rc=$?", tmp_path)
    assert "rc=124" in done.stdout
    skipped = _bash(f"source {SCRIPT}; limited 10 sleep 100; echo rc=$?", tmp_path)
    assert "rc=125" in skipped.stdout and "no time left" in skipped.stdout
