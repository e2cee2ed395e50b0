"""Cost of the sharded collection's NaN/inf gate: steps with ``skip_nonfinite`` on vs off.

On 2 gloo ranks (one thread each), per sharding type, the same batches run through two
otherwise identical ShardedEmbeddingBagCollections, alternating rounds so both see the same
load; reports the best round's seconds per step (forward + backward with the fused update)
and the difference, which is the gate's price: one 1-element all-reduce, one aminmax over the
output gradient and one host read per backward. On a loaded machine that difference is below
the noise, so the gate's parts are also timed alone (median of 200, this rank's output
gradient shape): ``gate_parts_ms``. ``*_faults_per_step``: minor page faults per step (this
process, last round), which large per-step temporaries cost wherever glibc hands them back to
the system (benchmarks/README.md, "Non-finite gradient gate"). Run:
``python benchmarks/bench_nonfinite.py [--tables 26] [--rows 100000] [--dim 64] [--batch 512]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import time
from typing import Any

import torch
from bench_sharding import _batches, _optimizer, _requests, _tables, _time_steps

from recopt.comm import all_ranks_finite
from recopt.modules.nonfinite import finite_flag
from recopt.sharding import construct_module_sharding_plan
from recopt.testing import run_on_ranks


def _compare(rank: int, world: int, args: argparse.Namespace, kind: str) -> dict[str, float]:
    from recopt.sharding import ShardedEmbeddingBagCollection

    torch.set_num_threads(1)
    tables = _tables(args)
    shardings = construct_module_sharding_plan(tables, _requests(kind, tables, world), world)
    modules = {
        gated: ShardedEmbeddingBagCollection(
            tables, shardings, optimizer=_optimizer(args), skip_nonfinite=gated
        )
        for gated in (True, False)
    }
    batches = _batches(args, args.batch, 100 + rank, args.steps + args.warmup)
    best = {True: float("inf"), False: float("inf")}
    faults = {True: 0.0, False: 0.0}
    for _ in range(args.rounds):
        for gated, module in modules.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            best[gated] = min(best[gated], _time_steps(module, batches, args.warmup)[0])
            after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            faults[gated] = (after - before) / len(batches)
    grad = torch.randn(args.batch, args.tables * args.dim)  # this rank's output gradient
    timeout = datetime.timedelta(seconds=60)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        all_ranks_finite(finite_flag([grad], grad.device), None, timeout)
        times.append(time.perf_counter() - start)
    return {
        "gated_step_s": best[True],
        "ungated_step_s": best[False],
        "gate_parts_ms": 1e3 * statistics.median(times),
        "gated_faults_per_step": faults[True],
        "ungated_faults_per_step": faults[False],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512, help="per rank")
    parser.add_argument("--ids", type=int, default=1, help="ids per bag")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--types", default="table_wise,row_wise,column_wise")
    parser.add_argument("--optimizer", default="row_wise_adagrad")
    parser.add_argument("--rounds", type=int, default=3, help="best of, alternating")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for kind in args.types.split(","):
        per_rank = run_on_ranks(_compare, args.world, args, kind, timeout_s=900)
        row = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        row["gate_ms"] = 1e3 * (row["gated_step_s"] - row["ungated_step_s"])
        results[kind] = row
    names = ("tables", "rows", "dim", "batch", "ids", "world", "optimizer", "rounds")
    config = {k: getattr(args, k) for k in names}
    print(json.dumps({"config": config, "results": results}, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
