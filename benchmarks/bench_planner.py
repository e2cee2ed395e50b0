"""Benchmark the sharding planner: planning speed, balance, and (later) whether its model predicts.

    .venv/bin/python benchmarks/bench_planner.py [--tables 1000 10000] [--world-size 64]

Part 1 times `EmbeddingShardingPlanner.plan` on synthetic table sets (targets: 1,000 tables on
64 ranks under 2 s, 10,000 under 20 s) and, when torchrec is importable, TorchRec's planner on
the same tables. Part 2, "does the model predict?", compares the estimated step time of several
plans with the measured one of `ShardedEmbeddingBagCollection` on 2 spawned ranks.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from recopt.modules import EmbeddingBagConfig
from recopt.sharding import validate_plan
from recopt.sharding.planner import EmbeddingShardingPlanner, Topology

GIB = 1024**3
TARGET_SECONDS = {1000: 2.0, 10000: 20.0}


def synthetic_tables(num_tables: int, seed: int = 0) -> list[EmbeddingBagConfig]:
    """Tables with a long-tailed size mix: many small, some large (1e2 to 2e6 rows)."""
    rng = random.Random(seed)
    tables = []
    for i in range(num_tables):
        rows = int(10 ** rng.uniform(2, 6.3))
        dim = rng.choice([16, 32, 64, 128])
        features = tuple(f"f{i}_{k}" for k in range(rng.choice([1, 1, 1, 2, 3])))
        tables.append(
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=features
            )
        )
    return tables


def bench_recopt(tables: list[EmbeddingBagConfig], world_size: int, repeats: int) -> dict[str, Any]:
    """Plan ``tables`` on ``world_size`` ranks ``repeats`` times; times and plan quality."""
    topology = Topology(world_size=world_size, ranks_per_host=8, ddr_bytes=64 * GIB)
    seconds = []
    for _ in range(repeats):
        planner = EmbeddingShardingPlanner(topology, batch_size=512)
        start = time.perf_counter()
        plan = planner.plan({"sparse.ebc": tables})
        seconds.append(time.perf_counter() - start)
    validate_plan(plan, {"sparse.ebc": tables}, world_size, topology.local_world_size)
    assert planner.stats is not None
    stats = planner.stats
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_over_lower_bound": stats.max_seconds / stats.lower_bound_seconds,
        "peak_memory_fraction": max(stats.rank_bytes) / stats.usable_bytes,
    }


def bench_torchrec(tables: list[EmbeddingBagConfig], world_size: int) -> float | None:
    """Seconds TorchRec's planner takes on the same tables, or ``None`` if torchrec is absent."""
    try:
        from torchrec.distributed.embeddingbag import (  # type: ignore[import-not-found]
            EmbeddingBagCollectionSharder,
        )
        from torchrec.distributed.planner import (  # type: ignore[import-not-found]
            EmbeddingShardingPlanner as TorchRecPlanner,
        )
        from torchrec.distributed.planner.types import (  # type: ignore[import-not-found]
            Topology as TorchRecTopology,
        )
        from torchrec.modules.embedding_configs import (  # type: ignore[import-not-found]
            EmbeddingBagConfig as TorchRecTable,
        )
        from torchrec.modules.embedding_modules import (  # type: ignore[import-not-found]
            EmbeddingBagCollection as TorchRecEBC,
        )
    except ImportError:
        return None
    import torch

    configs = [
        TorchRecTable(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
        )
        for t in tables
    ]
    model = TorchRecEBC(tables=configs, device=torch.device("meta"))
    planner = TorchRecPlanner(
        topology=TorchRecTopology(world_size=world_size, compute_device="cpu")
    )
    start = time.perf_counter()
    planner.plan(model, [EmbeddingBagCollectionSharder()])
    return time.perf_counter() - start


PREDICT_STEPS = 6  # measured steps per plan (after 2 warm-up steps)
PREDICT_BATCH = 256
PREDICT_POOLING = 4  # ids per bag


def _prediction_tables() -> list[EmbeddingBagConfig]:
    """A small mixed set that every layout can run on 2 ranks in seconds."""
    shapes = [
        (200_000, 64, 2),
        (100_000, 32, 1),
        (50_000, 128, 1),
        (20_000, 16, 3),
        (5_000, 64, 1),
        (500, 8, 1),
    ]
    return [
        EmbeddingBagConfig(
            name=f"p{i}",
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=tuple(f"p{i}_{k}" for k in range(features)),
        )
        for i, (rows, dim, features) in enumerate(shapes)
    ]


def _candidate_plans(tables: list[EmbeddingBagConfig], world_size: int) -> dict[str, Any]:
    """Plans to compare: one sharding type for every table, and the planner's choice."""
    from recopt.sharding import (
        ShardingPlan,
        balanced_table_wise_plan,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
    )

    def every(request: Any) -> ShardingPlan:
        per = {t.name: request for t in tables}
        return ShardingPlan({"": construct_module_sharding_plan(tables, per, world_size)})

    planner = EmbeddingShardingPlanner(Topology(world_size=world_size), batch_size=PREDICT_BATCH)
    return {
        "table_wise (balanced)": balanced_table_wise_plan({"": tables}, world_size),
        "row_wise": every(row_wise()),
        "column_wise": every(column_wise(list(range(world_size)))),
        "data_parallel": every(data_parallel()),
        "planner": planner.plan({"": tables}),
    }


def _measure_rank(rank: int, world_size: int, tables: list[Any], plans: list[str]) -> list[float]:
    """Median seconds of forward + backward (fused update) per plan, on this rank."""
    import datetime

    import torch
    import torch.distributed as dist

    from recopt.sharding import ShardingPlan
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
    from recopt.sparse import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(rank)
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    timeout = datetime.timedelta(seconds=120)
    medians = []
    for text in plans:
        ebc = ShardedEmbeddingBagCollection(tables, ShardingPlan.from_json(text)[""])
        times = []
        for step in range(2 + PREDICT_STEPS):
            lengths = torch.randint(
                0, 2 * PREDICT_POOLING + 1, (len(keys) * PREDICT_BATCH,), generator=gen
            )
            values = torch.cat(
                [
                    torch.randint(
                        0,
                        n,
                        (int(lengths[f * PREDICT_BATCH : (f + 1) * PREDICT_BATCH].sum()),),
                        generator=gen,
                    )
                    for f, n in enumerate(rows)
                ]
            )
            kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
            dist.monitored_barrier(timeout=timeout)
            start = time.perf_counter()
            ebc(kjt).values().sum().backward()
            if step >= 2:
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return medians


def _rank_order(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, i in enumerate(order):
        ranks[i] = position
    return ranks


def does_the_model_predict(world_size: int = 2) -> None:
    """Part 2: the planner's estimated step time against a measured one, for several plans.

    Spawns ``world_size`` gloo ranks, runs forward + backward (with the fused update) of
    `ShardedEmbeddingBagCollection` for each candidate plan, and prints the estimate
    (`evaluate_plan` on the default topology) beside the slowest rank's median step time, and
    the Spearman rank correlation: does a cheaper estimate run faster? On a shared machine the
    measurement is noisy; read the order more than the ratios.
    """
    try:
        from recopt.sharding.sharded_embedding import (  # noqa: F401
            ShardedEmbeddingBagCollection,
        )
    except ImportError:
        print(
            "does the model predict? skipped: recopt.sharding.ShardedEmbeddingBagCollection "
            "is not available"
        )
        return
    from recopt.sharding.planner import evaluate_plan
    from recopt.testing import run_on_ranks

    tables = _prediction_tables()
    plans = _candidate_plans(tables, world_size)
    topology = Topology(world_size=world_size)
    estimates = [
        evaluate_plan(p, {"": tables}, topology, PREDICT_BATCH, constraints=None).max_seconds
        for p in plans.values()
    ]
    per_rank = run_on_ranks(
        _measure_rank, world_size, tables, [p.to_json() for p in plans.values()], timeout_s=600
    )
    measured = [max(r[i] for r in per_rank) for i in range(len(plans))]
    print(
        f"does the model predict? {world_size} ranks, batch {PREDICT_BATCH} per rank "
        "(noisy: shared machine)"
    )
    print(f"{'plan':<24} {'estimated ms':>13} {'measured ms':>12} {'measured/est.':>14}")
    for name, est, got in zip(plans, estimates, measured, strict=True):
        print(f"{name:<24} {est * 1e3:>13.2f} {got * 1e3:>12.2f} {got / est:>14.2f}")
    a, b = _rank_order(estimates), _rank_order(measured)
    n = len(a)
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / (n * (n * n - 1))
    print(f"Spearman rank correlation (estimate vs measured): {rho:.2f}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 if a planning-speed target was missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-predict", action="store_true", help="skip part 2")
    args = parser.parse_args(argv)
    missed = False
    print("Wall-clock timings of this machine; on a shared machine they are noisy.")
    for n in args.tables:
        tables = synthetic_tables(n)
        result = bench_recopt(tables, args.world_size, args.repeats if n <= 1000 else 1)
        target = TARGET_SECONDS.get(n)
        verdict = ""
        if target is not None:
            met = result["min_s"] < target
            missed |= not met
            verdict = f" (target < {target:.0f} s: {'met' if met else 'MISSED'})"
        print(
            f"recopt planner: {n} tables on {args.world_size} ranks: median "
            f"{result['median_s']:.2f} s, best {result['min_s']:.2f} s{verdict}; est. step / "
            f"lower bound {result['max_over_lower_bound']:.3f}; peak memory "
            f"{result['peak_memory_fraction']:.1%} of usable"
        )
        torchrec_s = bench_torchrec(tables, args.world_size)
        if torchrec_s is None:
            print("torchrec planner: torchrec is not importable here; no comparison")
        else:
            print(f"torchrec planner: {n} tables on {args.world_size} ranks: {torchrec_s:.2f} s")
    if not args.skip_predict:
        does_the_model_predict()
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
