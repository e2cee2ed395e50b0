"""Run a function on N spawned ranks joined in a process group, for tests and benchmarks.

The group is gloo on CPU by default; ``backend="cuda:gloo"`` puts every rank on the one GPU of
the host (gloo moves CUDA tensors and, like NCCL, refuses CPU tensors in such a group), so the
multi-GPU logic runs on a single GPU. Every rank gets a `file://` rendezvous in a private
temporary directory (no port races) and a timeout on its process group; the parent collects
each rank's return value or traceback and kills the group as soon as one rank fails, so a
failure surfaces as that error, not a hang. The ranks are killed whatever ends the call (an
exception, pytest's timeout, Ctrl-C) and die with the parent process (Linux), so none holds a
GPU or cores once its test is over. Ranks get ``cpu_count // (world_size * xdist workers)``
torch threads each.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import queue
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recopt import comm


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds every rank's report."""


def _rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    timeout_s: float,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    threads: int,
) -> None:
    _die_with_parent()
    torch.set_num_threads(threads)
    try:
        device = torch.device("cpu")
        if "cuda" in backend or "nccl" in backend:  # ranks spread over the GPUs, or share one
            device = torch.device("cuda", rank % torch.cuda.device_count())
        comm.init_process_group(
            device,
            backend=backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank's connections are up before any runs ``fn``: a rank whose ``fn`` needs no
        # collective could otherwise finish and close its end of the mesh while a slower
        # peer is still connecting ("Gloo connectFullMesh failed ... closed by peer").
        comm.barrier(None, datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        # Pickled by value here (plain pickle, not the shared-memory reducer), so the result
        # survives this process exiting before the parent reads it.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: B036 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    grace_s: float = 5.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level (picklable) function; it runs after the group is initialised.
        world_size: number of ranks.
        *args: extra picklable arguments passed to every rank.
        timeout_s: limit for the whole run and for every collective of the process group.
        grace_s: once a rank has failed, how long the others get to report before being killed.
        backend: the default group's backend: ``"gloo"`` (CPU), or one naming ``cuda``, such as
            ``"cuda:gloo"``: rank ``r`` uses GPU ``r % device_count`` (on a one-GPU host every
            rank shares it; NCCL refuses that, so a backend with NCCL needs a GPU per rank).

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        RankFailure: naming each failed rank with its traceback (or its exit code / timeout).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = rank_threads(world_size, os.cpu_count(), os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
    with tempfile.TemporaryDirectory(prefix="recopt-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        rank_args = (world_size, init_file, timeout_s, results, fn, args, backend, threads)
        procs = [
            ctx.Process(target=_rank_main, args=(rank, *rank_args), daemon=True)
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            reports = _collect(procs, results, world_size, timeout_s, grace_s)
        finally:  # also on pytest's timeout or Ctrl-C: no rank may outlive this call
            _kill(procs)
    failures = [
        f"rank {r}: {msg}" for r, (status, msg) in sorted(reports.items()) if status != "ok"
    ]
    if failures:
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures))
    return [pickle.loads(reports[r][1]) for r in range(world_size)]


def rank_threads(world_size: int, cpu_count: int | None, xdist_workers: str | None) -> int:
    """Torch threads per rank: the cores shared by the ranks of this call and, under
    pytest-xdist (``PYTEST_XDIST_WORKER_COUNT``), by every worker's ranks; at least 1."""
    workers = int(xdist_workers) if xdist_workers and xdist_workers.isdigit() else 1
    return max(1, (cpu_count or 1) // (world_size * max(1, workers)))


def _kill(procs: list[Any]) -> None:
    """Kills the ranks still alive and reaps all of them (ranks never started are skipped)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


def _die_with_parent() -> None:
    """On Linux, ask the kernel to kill this rank when its parent dies, so ranks do not outlive
    a parent killed without running its ``finally`` (pytest-timeout's thread method exits at
    once; a SIGKILL). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _collect(
    procs: list[Any], results: Any, world_size: int, timeout_s: float, grace_s: float
) -> dict[int, tuple[str, Any]]:
    import time

    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world_size:
        failed = any(status != "ok" for status, _ in reports.values())
        now = time.monotonic()
        if now > deadline:
            break
        try:
            rank, status, payload = results.get(timeout=min(0.5, max(0.01, deadline - now)))
            reports[rank] = (status, payload)
            if status != "ok":
                deadline = min(deadline, time.monotonic() + grace_s)
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in reports and not p.is_alive() and p.exitcode not in (None, 0):
                reports[rank] = ("error", f"process died with exit code {p.exitcode}")
                deadline = min(deadline, time.monotonic() + grace_s)
        if failed:
            deadline = min(deadline, time.monotonic() + grace_s)
    for rank in range(world_size):
        if rank not in reports:
            reports[rank] = ("error", f"no report within the time limit ({timeout_s:.0f} s)")
    return reports
