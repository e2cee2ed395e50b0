"""The pipelined remap worker's host time per step, beside its native calls (issue 26).

`TrainPipelineSparseDist` remaps batch i+1 on a worker thread during batch i. The worker's
native calls release the GIL; the rest of its step (Python, torch ops, copies) holds it, and
the training thread waits for that whenever it wants the GIL meanwhile: on a GPU, whose
training thread mostly queues kernels, that is host time on the step's critical path. This
runs the id_map pipeline of `bench_id_map.py` (Criteo-shaped tables, row-wise Adagrad) with
the worker's step run inline on the training thread, at the point where the threaded
pipeline's worker would start it after the forward took the previous step (so its timings
are not mixed with the training step's), and times the whole step and its native calls
(`rim_*` of `recopt/kernels/cpu_id_map.c`) apart. Medians of the last half of the steps.

    python benchmarks/bench_id_map_worker.py --stream drifting worst --steps 200 --threads 1
    python benchmarks/bench_id_map_worker.py --device cuda --remap-threads 4   # a GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_id_map import _ID_MAPS, NUM_TABLES, STREAMS, SummedLoss, _Setup, _Stream

from recopt.kernels import cpu_id_map
from recopt.modules import id_map_ahead, id_map_stage
from recopt.sharding import TrainPipelineSparseDist


class _Timed:
    """The worker steps' times, and their native calls' (on the thread running a step)."""

    def __init__(self) -> None:
        self.step: list[float] = []
        self.native: list[float] = []
        self._inside = threading.local()

    def run(self, step: Callable[[], None]) -> None:
        self._inside.native = 0.0
        start = time.perf_counter()
        try:
            step()
        finally:
            self.step.append(time.perf_counter() - start)
            self.native.append(self._inside.native)
            self._inside.native = None

    def library(self, library: Any) -> Any:
        """``library`` with its ``rim_*`` calls timed while a worker step runs."""
        timed = self

        class Library:
            def __getattr__(self, name: str) -> Any:
                call = getattr(library, name)
                if not name.startswith("rim_"):
                    return call

                def native(*args: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return call(*args)
                    finally:
                        if getattr(timed._inside, "native", None) is not None:
                            timed._inside.native += time.perf_counter() - start

                return native

        return Library()


@contextlib.contextmanager
def inline_worker(timed: _Timed) -> Iterator[None]:
    """Run every ahead remap's worker step on the calling thread right after the forward
    took the step before it (timed by ``timed``), instead of on the worker thread."""
    pending: list[tuple[Any, Callable[[], None]]] = []
    submit, take = id_map_ahead.AheadSteps.submit, id_map_stage.RemapStage.take
    library = cpu_id_map.library

    def queue(self: Any, remap: Any, step: Callable[[], None], background: bool) -> Any:
        self.add(remap)
        pending.append((remap, step))
        return remap

    def take_then_step(self: Any, features: Any, training: bool) -> Any:
        for remap, step in list(pending):  # (the first batch: its own step first)
            if remap.features is features:
                pending.remove((remap, step))
                timed.run(step)
        taken = take(self, features, training)
        while pending:
            timed.run(pending.pop(0)[1])
        return taken

    wrapped = timed.library(library())
    id_map_ahead.AheadSteps.submit = queue
    id_map_stage.RemapStage.take = take_then_step
    cpu_id_map.library = lambda: wrapped
    try:
        yield
    finally:
        id_map_ahead.AheadSteps.submit = submit
        id_map_stage.RemapStage.take = take
        cpu_id_map.library = library


def measure(
    stream: str, rows: int, warmup: int, steps: int, device: str = "cpu", threads: int = 1
) -> dict[str, float]:
    """Medians (ms) over the last half of ``steps`` (after ``warmup``): the worker's step,
    its native calls (over ``threads``), the rest; and the pipelined step with the worker's
    step in it (on CUDA until the device is idle). ``device``: the tables' (a CUDA table's
    maps stay on the host)."""
    setup = _Setup(rows, _ID_MAPS[stream], False, device)
    cuda = torch.device(device).type == "cuda"
    data = _Stream(stream, rows)
    data.make(warmup + steps + 4)
    timed = _Timed()
    batches = data.batches(modulo=False)
    step_times: list[float] = []
    with inline_worker(timed):
        model = SummedLoss(setup.mapped)
        pipeline = TrainPipelineSparseDist(model, None, device, remap_threads=threads)
        for _ in range(warmup):
            pipeline.progress(batches)
        timed.step.clear()
        timed.native.clear()
        for _ in range(steps):
            start = time.perf_counter()
            pipeline.progress(batches)
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
    half = len(timed.step) // 2
    rest = [s - n for s, n in zip(timed.step, timed.native, strict=True)]
    return {
        "worker step": 1e3 * statistics.median(timed.step[half:]),
        "native calls": 1e3 * statistics.median(timed.native[half:]),
        "the rest": 1e3 * statistics.median(rest[half:]),
        "pipelined step": 1e3 * statistics.median(step_times[len(step_times) // 2 :]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", nargs="+", choices=STREAMS, default=["drifting"])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=80, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--remap-threads", type=int, default=1, help="the native remap's")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the tables there)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_id_map.available():
        parser.error("the native id map did not build here (no C compiler?)")
    print(
        f"{NUM_TABLES} tables x {args.rows} rows on {args.device}, {torch.get_num_threads()} "
        f"threads, remap threads {args.remap_threads}, the worker's step inline (ms, medians "
        f"of the last {args.steps - args.steps // 2} steps)\n"
        "| stream | worker step | native calls | the rest (host, GIL held) | pipelined step |\n"
        "| --- | ---: | ---: | ---: | ---: |"
    )
    for stream in args.stream:
        got = measure(stream, args.rows, args.warmup, args.steps, args.device, args.remap_threads)
        print(f"| {stream} | " + " | ".join(f"{value:.2f}" for value in got.values()) + " |")


if __name__ == "__main__":
    main()
