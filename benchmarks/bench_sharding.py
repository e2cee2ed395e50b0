"""Sharded embedding stage throughput: 2 gloo ranks per sharding type vs one process.

Global samples/s of a 26-table stage (forward + backward with the fused update) for each
sharding type on 2 ranks, against the single-process FusedEmbeddingBagCollection doing the
same total work (the global batch), with the forward split by phase. Run:
``python benchmarks/bench_sharding.py [--dim 128] [--batch 4096] [--ids 20]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sharding import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks


def _optimizer(args: argparse.Namespace) -> FusedOptimizerConfig:
    return FusedOptimizerConfig(name=args.optimizer, lr=0.01)


def _tables(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=(f"f{i}",)
        )
        for i in range(args.tables)
    ]


def _batches(args: argparse.Namespace, batch: int, seed: int, count: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(args.tables)]
    out = []
    for _ in range(count):
        lengths = torch.full((args.tables * batch,), args.ids, dtype=torch.int64)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths))
    return out


def _requests(kind: str, tables: list[EmbeddingBagConfig], world: int) -> dict[str, Any]:
    if kind == "table_wise":
        return {t.name: table_wise(i % world) for i, t in enumerate(tables)}
    if kind == "row_wise":
        return {t.name: row_wise() for t in tables}
    if kind == "column_wise":
        return {t.name: column_wise(list(range(world))) for t in tables}
    return {t.name: data_parallel() for t in tables}


def _time_steps(module: Any, batches: list[Any], warmup: int) -> tuple[float, float]:
    """Seconds per step (forward + backward) after warmup, and backward seconds per step."""
    backward = 0.0
    start = 0.0
    for i, kjt in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
            backward = 0.0
            if hasattr(module, "phase_seconds"):
                module.phase_seconds = {}
        out = module(kjt).values()
        t0 = time.perf_counter()
        out.sum().backward()
        backward += time.perf_counter() - t0
    steps = len(batches) - warmup
    return (time.perf_counter() - start) / steps, backward / steps


def _sharded(rank: int, world: int, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    from recopt.sharding import ShardedEmbeddingBagCollection

    torch.set_num_threads(1)  # one core per rank on this 2-core machine
    tables = _tables(args)
    shardings = construct_module_sharding_plan(tables, _requests(kind, tables, world), world)
    module = ShardedEmbeddingBagCollection(tables, shardings, optimizer=_optimizer(args))
    batches = _batches(args, args.batch, 100 + rank, args.steps + args.warmup)
    step, backward = _time_steps(module, batches, args.warmup)
    phases = {k: v / args.steps for k, v in (module.phase_seconds or {}).items()}
    return {"step_s": step, "backward_s": backward, **phases}


def _single(args: argparse.Namespace, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    module = FusedEmbeddingBagCollection(_tables(args), optimizer=_optimizer(args))
    batches = _batches(args, args.batch * args.world, 7, args.steps + args.warmup)
    step, backward = _time_steps(module, batches, args.warmup)
    return {"step_s": step, "backward_s": backward}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4096, help="per rank")
    parser.add_argument("--ids", type=int, default=20, help="ids per bag")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--types", default="table_wise,row_wise,column_wise,data_parallel")
    parser.add_argument("--optimizer", default="row_wise_adagrad")
    parser.add_argument("--rounds", type=int, default=2, help="best of, interleaved")
    args = parser.parse_args(argv)
    global_batch = args.batch * args.world
    results: dict[str, Any] = {}

    def keep_best(name: str, row: dict[str, float]) -> None:
        # The machine is shared: keep each configuration's fastest round.
        if name not in results or row["step_s"] < results[name]["step_s"]:
            results[name] = row

    for _ in range(args.rounds):  # interleaved, so every configuration sees the same noise
        # One process with as many threads as there are ranks (the same cores), and with one
        # thread (OpenMP threads spin badly on a loaded machine; this bounds that effect).
        for name, threads in (("single_process", args.world), ("single_process_1_thread", 1)):
            single = _single(args, threads)
            keep_best(name, {**single, "samples_per_s": global_batch / single["step_s"]})
        for kind in args.types.split(","):
            per_rank = run_on_ranks(_sharded, args.world, args, kind, timeout_s=900)
            row = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            row["samples_per_s"] = global_batch / row["step_s"]
            keep_best(kind, row)
    for row in results.values():
        row["vs_single"] = results["single_process"]["step_s"] / row["step_s"]
    names = ("tables", "rows", "dim", "batch", "ids", "world", "optimizer", "rounds")
    config = {k: getattr(args, k) for k in names}
    print(json.dumps({"config": config, "results": results}, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
