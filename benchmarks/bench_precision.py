"""fp16 against fp32 embedding weights on CPU: step time on both backends, and memory per row.

One process builds five row-wise Adagrad kernels on config A (8 tables x 1M rows x 64, batch
4096, 20 uniform ids per bag): recopt fp32, recopt fp16 with stochastic rounding and rounded
to nearest, fbgemm fp32, fbgemm fp16 (its CPU build rounds to nearest). Rounds interleave the
candidates on the same batches, so load swings hit them alike; the median ms per step
(forward + backward + update) and the ratio to the backend's fp32 are printed, with the bytes
each table holds (weights and state).

    python benchmarks/bench_precision.py             # config A (about a minute)
    python benchmarks/bench_precision.py --quick     # small tables, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_embedding import CONFIGS, QUICK, Batch, Config, make_batches  # noqa: E402

from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec  # noqa: E402
from recopt.kernels.contract import Kernel  # noqa: E402

OPTIMIZER = "row_wise_adagrad"


# (backend, weight dtype, stochastic rounding); fbgemm's CPU build rounds to nearest only.
CANDIDATES = [
    ("recopt", "fp32", True),
    ("recopt", "fp16", True),
    ("recopt", "fp16", False),
    ("fbgemm", "fp32", False),
    ("fbgemm", "fp16", False),
]
Candidate = tuple[str, str, bool]


def build(cfg: Config, backend: str, weight_dtype: str, stochastic: bool) -> Kernel:
    """One kernel over the config's tables, weights in ``weight_dtype``."""
    tables = [
        TableSpec(
            name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim, weight_dtype=weight_dtype
        )
        for i in range(cfg.num_tables)
    ]
    features = list(range(cfg.num_tables))
    cpu = torch.device("cpu")
    config = FusedOptimizerConfig(name=OPTIMIZER, stochastic_rounding=stochastic)
    if backend == "recopt":
        from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

        return RecoptTableBatchedEmbedding(tables, features, config, PoolingType.SUM, cpu)
    from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding

    return FbgemmTableBatchedEmbedding(tables, features, config, PoolingType.SUM, cpu)


def table_bytes(kernel: Kernel) -> int:
    """Bytes of table 0's weights and optimizer state."""
    weight = kernel.split_embedding_weights()[0]
    state = kernel.split_optimizer_states()[0]
    return weight.nbytes + sum(t.nbytes for t in state.values())


def time_steps(kernel: Kernel, batches: list[Batch], grad: torch.Tensor) -> list[float]:
    times = []
    for batch in batches:
        start = time.perf_counter()
        kernel(*batch).backward(grad)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables (smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per candidate a round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = (QUICK if args.quick else CONFIGS)["A"]
    batches = make_batches(cfg, args.steps)
    grad = torch.randn(cfg.batch, cfg.num_tables * cfg.dim)
    names = CANDIDATES
    kernels: dict[Candidate, Kernel] = {n: build(cfg, *n) for n in names}
    for kernel in kernels.values():
        time_steps(kernel, batches[:1], grad)  # warm-up: pages, library loads
    samples: dict[Candidate, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            samples[name] += time_steps(kernels[name], batches, grad)
    print(
        f"config {cfg.name}: {cfg.num_tables} tables x {cfg.rows} rows x dim {cfg.dim}, batch "
        f"{cfg.batch}, {cfg.ids_per_bag} uniform ids per bag, {OPTIMIZER}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds x {args.steps} steps"
    )
    print("| backend | weights | rounding | ms/step | vs fp32 | MB per table | rows per MB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    medians = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
    for name in names:
        backend, dtype, stochastic = name
        ms = medians[name]
        fp32 = next(medians[n] for n in names if n[0] == backend and n[1] == "fp32")
        nbytes = table_bytes(kernels[name])
        rounding = "-" if dtype == "fp32" else ("stochastic" if stochastic else "nearest")
        print(
            f"| {backend} | {dtype} | {rounding} | {ms:.1f} | {ms / fp32:.2f}x | "
            f"{nbytes / 2**20:.1f} | {cfg.rows / (nbytes / 2**20):,.0f} |"
        )


if __name__ == "__main__":
    main()
