"""Owner-local id maps (issue 26): the sharded step with `id_map` next to the same step on
ids taken modulo the rows, on gloo ranks, and where the difference goes.

Row-wise tables (8 x rows x 32, row-wise Adagrad, one id per bag, ``--batch`` bags per rank
and table) fed raw ids from a drifting power law over 2^40 ids. The two candidates run
interleaved in one run, after a warm-up that fills the maps (so they evict): a training step
(forward + backward) of a `ShardedEmbeddingBagCollection` without `id_map` on ``raw % rows``,
and of one with `id_map` (lru) on the raw ids. Prints rank 0's medians, the ratio, and the
input-distribution phase of each (with `id_map` it holds the owners' remap). ``--pipeline``:
both through `TrainPipelineSparseDist` (the owners then map batch i+1's ids on a worker thread
during batch i's backward; a rank needs a core free for it).

    python benchmarks/bench_id_map_sharded.py                    # 2 ranks, 8 x 50k rows
    python benchmarks/bench_id_map_sharded.py --ranks 3 --rows 20000 --steps 10
    python benchmarks/bench_id_map_sharded.py --ranks 1 --pipeline
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_id_map import SummedLoss, bench_tables, one_id_bags, worst_ids

from recopt.data.batch import Batch
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import IdMapConfig
from recopt.testing import run_on_ranks

NUM_TABLES, DIM = 8, 32
CANDIDATES = ("modulo step", "id_map step")


def _bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    from recopt.sharding import construct_module_sharding_plan, row_wise
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    torch.set_num_threads(1)
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.01)
    modules = {}
    for name, id_map in zip(CANDIDATES, (None, IdMapConfig(policy="lru")), strict=True):
        tables = bench_tables(args.rows, id_map, NUM_TABLES, DIM)
        plan = construct_module_sharding_plan(tables, {t.name: row_wise() for t in tables}, world)
        modules[name] = ShardedEmbeddingBagCollection(tables, plan, optimizer=config)
    gen = torch.Generator().manual_seed(rank)
    if args.pipeline:
        return _pipelined(modules, gen, args)
    times: dict[str, list[float]] = {f"{n}{k}": [] for n in CANDIDATES for k in ("", " input")}
    for step in range(args.warmup + args.steps):
        raw = worst_ids(args.rows, step, gen, NUM_TABLES, args.batch)
        for name, module in modules.items():
            ids = raw % args.rows if name == "modulo step" else raw
            module.phase_seconds = {}
            start = time.perf_counter()
            module(one_id_bags(ids, NUM_TABLES, args.batch)).values().sum().backward()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
                times[f"{name} input"].append(module.phase_seconds["input_dist"])
    return times


def _pipelined(
    modules: dict[str, Any], gen: torch.Generator, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Both candidates through `TrainPipelineSparseDist`, a step of each in turn (the id_map
    one maps batch i+1's ids on the worker thread during batch i's backward)."""
    from recopt.sharding import TrainPipelineSparseDist

    total = args.warmup + args.steps
    raw = [worst_ids(args.rows, step, gen, NUM_TABLES, args.batch) for step in range(total)]
    empty = torch.zeros(args.batch)

    def batch(step: int, ids: torch.Tensor) -> Batch:
        return Batch(empty[:, None], one_id_bags(ids, NUM_TABLES, args.batch), empty, step)

    batches = {
        name: iter([batch(s, r % args.rows if i == 0 else r) for s, r in enumerate(raw)])
        for i, name in enumerate(CANDIDATES)
    }
    pipes = {
        name: TrainPipelineSparseDist(SummedLoss(module), None, "cpu")
        for name, module in modules.items()
    }
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for step in range(total - 2):  # (the pipelines hold two batches ahead)
        for name, pipe in pipes.items():
            start = time.perf_counter()
            pipe.progress(batches[name])
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="both steps through TrainPipelineSparseDist (no input-phase figures)",
    )
    args = parser.parse_args(argv)
    times = run_on_ranks(_bench, args.ranks, args, timeout_s=1800.0)[0]
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = median["modulo step"]
    for key, value in median.items():
        print(f"{key:>20}: {value:8.2f} ms  ({value / base:.2f}x the modulo step)")


if __name__ == "__main__":
    main()
