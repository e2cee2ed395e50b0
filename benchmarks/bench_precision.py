"""fp16 against fp32 embedding weights on CPU: step time on both backends, and memory per row.

One process builds four row-wise Adagrad kernels on config A (8 tables x 1M rows x 64, batch
4096, 20 uniform ids per bag): recopt fp32, recopt fp16 (stochastic rounding), fbgemm fp32,
fbgemm fp16 (its CPU build rounds to nearest). Rounds interleave the candidates on the same
batches, so load swings hit all four alike; the median ms per step (forward + backward +
update) and the fp16 / fp32 ratio per backend are printed, with the bytes each table holds.

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


def build(cfg: Config, backend: str, weight_dtype: str) -> Kernel:
    """One kernel over the config's tables, weights in ``weight_dtype``."""
    tables = [
        TableSpec(
            name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim, weight_dtype=weight_dtype
        )
        for i in range(cfg.num_tables)
    ]
    features = list(range(cfg.num_tables))
    cpu = torch.device("cpu")
    if backend == "recopt":
        from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

        config = FusedOptimizerConfig(name=OPTIMIZER)
        return RecoptTableBatchedEmbedding(tables, features, config, PoolingType.SUM, cpu)
    from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding

    # fbgemm's CPU kernels round fp16 updates to nearest: say so rather than refuse.
    config = FusedOptimizerConfig(name=OPTIMIZER, stochastic_rounding=False)
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
    names = [(b, d) for b in ("recopt", "fbgemm") for d in ("fp32", "fp16")]
    kernels: dict[tuple[str, str], Kernel] = {n: build(cfg, *n) for n in names}
    for kernel in kernels.values():
        time_steps(kernel, batches[:1], grad)  # warm-up: pages, library loads
    samples: dict[tuple[str, str], list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            samples[name] += time_steps(kernels[name], batches, grad)
    print(
        f"config {cfg.name}: {cfg.num_tables} tables x {cfg.rows} rows x dim {cfg.dim}, batch "
        f"{cfg.batch}, {cfg.ids_per_bag} uniform ids per bag, {OPTIMIZER}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds x {args.steps} steps"
    )
    print(
        "| backend | weights | ms/step (median) | fp16 / fp32 time | MB per table | rows per MB |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    medians = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
    for backend, dtype in names:
        ms = medians[(backend, dtype)]
        ratio = ms / medians[(backend, "fp32")]
        nbytes = table_bytes(kernels[(backend, dtype)])
        print(
            f"| {backend} | {dtype} | {ms:.1f} | {ratio:.2f}x | {nbytes / 2**20:.1f} | "
            f"{cfg.rows / (nbytes / 2**20):,.0f} |"
        )


if __name__ == "__main__":
    main()
