"""`recopt.testing.run_on_ranks` never leaves a rank behind: not when pytest's timeout (a signal
in the parent) or Ctrl-C ends the call, not when the parent is killed outright; every
`run_on_ranks` timeout in the suite is below pytest's; ranks' threads share the cores with the
other xdist workers.
"""

from __future__ import annotations

import ast
import configparser
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

import recopt.testing
from recopt.testing import rank_threads, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _sleeper(rank: int, world: int, pid_dir: str) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _pids(pid_dir: Path, world: int) -> list[int] | None:
    files = [pid_dir / f"{rank}.pid" for rank in range(world)]
    if not all(f.exists() and f.read_text() for f in files):
        return None
    return [int(f.read_text()) for f in files]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped by its parent.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


@pytest.fixture
def pid_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for pid in _pids(tmp_path, 2) or []:  # without the fix the ranks would still run: end them
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


class _Timeout(Exception):
    """What pytest-timeout's signal method raises in the parent."""


def _wait_for_ranks_then(pid_dir: Path, fire: Callable[[], None]) -> Callable[..., None]:
    """A SIGALRM handler that calls ``fire`` once both ranks are up, else re-arms itself."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if _pids(pid_dir, 2) is None:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            return
        fire()

    return handler


def _raise(error: BaseException) -> Callable[[], None]:
    def fire() -> None:
        raise error

    return fire


@pytest.mark.multiprocess
@pytest.mark.parametrize("error", [_Timeout("pytest-timeout"), KeyboardInterrupt()])
def test_a_signal_ending_the_call_kills_every_rank(pid_dir: Path, error: BaseException) -> None:
    previous = signal.signal(signal.SIGALRM, _wait_for_ranks_then(pid_dir, _raise(error)))
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(type(error)):
            run_on_ranks(_sleeper, 2, str(pid_dir), timeout_s=200)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pids = _pids(pid_dir, 2)
    assert pids is not None and len(set(pids)) == 2
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.multiprocess
def test_an_error_while_collecting_kills_every_rank(
    pid_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_collect(*args: object) -> None:
        while _pids(pid_dir, 2) is None:
            time.sleep(0.2)
        raise RuntimeError("collect broke")

    monkeypatch.setattr(recopt.testing, "_collect", failing_collect)
    with pytest.raises(RuntimeError, match="collect broke"):
        run_on_ranks(_sleeper, 2, str(pid_dir), timeout_s=200)
    pids = _pids(pid_dir, 2)
    assert pids is not None and [pid for pid in pids if _alive(pid)] == []


PARENT = """
import sys
sys.path.insert(0, {tests!r})
from test_run_on_ranks import _sleeper
from recopt.testing import run_on_ranks
run_on_ranks(_sleeper, 2, {pid_dir!r}, timeout_s=200)
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_parent_killed_outright(pid_dir: Path) -> None:
    # pytest-timeout's thread method (or a SIGKILL) ends the parent without its `finally`.
    code = PARENT.format(tests=str(ROOT / "tests"), pid_dir=str(pid_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 200
        while _pids(pid_dir, 2) is None and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent exited before its ranks started"
            time.sleep(0.2)
        pids = _pids(pid_dir, 2)
        assert pids is not None
    finally:
        parent.kill()
        parent.wait()
    # The kernel signals the orphans at once; allow them a moment to be gone.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in pids if _alive(pid)] == []


def test_rank_threads_share_the_cores_with_the_xdist_workers() -> None:
    assert rank_threads(2, 16, None) == 8
    assert rank_threads(2, 16, "12") == 1  # 24 ranks on 16 cores: one thread each
    assert rank_threads(1, 16, "4") == 4
    assert rank_threads(2, 16, "") == 8 and rank_threads(2, 16, "x") == 8
    assert rank_threads(3, 2, None) == 1 and rank_threads(2, None, None) == 1


def _pytest_timeout() -> float:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return float(config["tool:pytest"]["timeout"])


def _rank_timeouts(path: Path) -> Iterator[tuple[int, float]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        if name != "run_on_ranks":
            continue
        for keyword in node.keywords:
            if keyword.arg == "timeout_s" and isinstance(keyword.value, ast.Constant):
                yield node.lineno, float(keyword.value.value)


def test_every_run_on_ranks_timeout_is_below_pytests() -> None:
    # At or above pytest's limit, pytest's timeout fires first and the ranks' own reports
    # (which rank hung, where) are never shown.
    limit = _pytest_timeout()
    found = [
        f"{path.name}:{line} timeout_s={value:g}"
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        for line, value in _rank_timeouts(path)
        if value >= limit
    ]
    assert found == [], f"run_on_ranks timeouts not below pytest's {limit:g} s: {found}"
