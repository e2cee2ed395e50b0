"""fp16/bf16 against fp32 weights and optimizer state on CPU: step time and memory per row.

One process builds the kernels of one group on config A (8 tables x 1M rows x 64, batch 4096,
20 uniform ids per bag; row-wise Adagrad unless ``--optimizer``). Group ``weights``: recopt
fp32, recopt fp16 with stochastic rounding and rounded to nearest, fbgemm fp32, fbgemm fp16
(its CPU build rounds to nearest). Group ``state``: recopt fp32, then fp16/bf16 weights with
fp16/bf16 optimizer state (``state_dtype``), stochastic and to nearest. Rounds interleave the
candidates on the same batches, so load swings hit them alike; the median ms per step
(forward + backward + update) and the ratio to the backend's fp32 (same run) are printed, with
the bytes each table holds (weights and state).

    python benchmarks/bench_precision.py                  # group weights, config A (a minute)
    python benchmarks/bench_precision.py --group state    # reduced state and nearest rounding
    python benchmarks/bench_precision.py --quick          # small tables, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_embedding import CONFIGS, QUICK, Batch, Config, make_batches  # noqa: E402

from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec  # noqa: E402
from recopt.kernels.contract import Kernel  # noqa: E402

# (backend, weight dtype, state dtype, stochastic rounding); fbgemm's CPU build rounds to
# nearest only and keeps fp32 state.
Candidate = tuple[str, str, str, bool]
GROUPS: dict[str, list[Candidate]] = {
    "weights": [
        ("recopt", "fp32", "fp32", True),
        ("recopt", "fp16", "fp32", True),
        ("recopt", "fp16", "fp32", False),
        ("fbgemm", "fp32", "fp32", False),
        ("fbgemm", "fp16", "fp32", False),
    ],
    "state": [
        ("recopt", "fp32", "fp32", True),
        ("recopt", "fp32", "bf16", True),
        ("recopt", "fp16", "fp16", True),
        ("recopt", "fp16", "fp16", False),
        ("recopt", "bf16", "bf16", True),
        ("recopt", "bf16", "bf16", False),
    ],
}


def build(cfg: Config, optimizer: str, candidate: Candidate) -> Kernel:
    """One kernel over the config's tables, weights and state in the candidate's dtypes."""
    backend, weight_dtype, state_dtype, stochastic = candidate
    tables = [
        TableSpec(
            name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim, weight_dtype=weight_dtype
        )
        for i in range(cfg.num_tables)
    ]
    features = list(range(cfg.num_tables))
    cpu = torch.device("cpu")
    config = FusedOptimizerConfig(
        name=optimizer, stochastic_rounding=stochastic, state_dtype=state_dtype
    )
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
    parser.add_argument("--group", choices=sorted(GROUPS), default="weights")
    parser.add_argument("--optimizer", default="row_wise_adagrad")
    parser.add_argument("--rows", type=int, default=0, help="rows per table (0: the config's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per candidate a round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = (QUICK if args.quick else CONFIGS)["A"]
    if args.rows:
        cfg = dataclasses.replace(cfg, rows=args.rows)
    batches = make_batches(cfg, args.steps)
    grad = torch.randn(cfg.batch, cfg.num_tables * cfg.dim)
    names = GROUPS[args.group]
    kernels: dict[Candidate, Kernel] = {n: build(cfg, args.optimizer, n) for n in names}
    for kernel in kernels.values():
        time_steps(kernel, batches[:1], grad)  # warm-up: pages, library loads
    samples: dict[Candidate, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            samples[name] += time_steps(kernels[name], batches, grad)
    print(
        f"config {cfg.name}: {cfg.num_tables} tables x {cfg.rows} rows x dim {cfg.dim}, batch "
        f"{cfg.batch}, {cfg.ids_per_bag} uniform ids per bag, {args.optimizer}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds x {args.steps} steps"
    )
    columns = "backend weights state rounding ms/step | vs fp32 | MB per table | rows per MB"
    print("| " + " | ".join(columns.split(" ", 4)) + " |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    medians = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
    for name in names:
        backend, weights, state, stochastic = name
        ms = medians[name]
        fp32 = next(medians[n] for n in names if n[0] == backend and n[1:3] == ("fp32", "fp32"))
        nbytes = table_bytes(kernels[name])
        rounding = "stochastic" if stochastic else "nearest"
        if (weights, state) == ("fp32", "fp32"):
            rounding = "-"
        print(
            f"| {backend} | {weights} | {state} | {rounding} | {ms:.1f} | {ms / fp32:.2f}x | "
            f"{nbytes / 2**20:.1f} | {cfg.rows / (nbytes / 2**20):,.0f} |"
        )


if __name__ == "__main__":
    main()
