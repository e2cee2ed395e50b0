"""Fused embedding kernels on CPU: forward + backward + optimizer update, side by side.

Candidates (same tables, same batches, one run): recopt's kernel with each optimizer, fbgemm's
raw ``SplitTableBatchedEmbeddingBagsCodegen`` (sgd / adagrad / row-wise adagrad), recopt's
``FusedEmbeddingBagCollection`` (issue 2), and ``nn.EmbeddingBag(sparse=True)`` with
``torch.optim.SparseAdam`` / ``torch.optim.Adagrad``. Also measured in the same run: memory
copy bandwidth and random-row gather bandwidth, the floor every candidate is held against.

    python benchmarks/bench_fused_embedding.py            # configs A and B (a few minutes)
    python benchmarks/bench_fused_embedding.py --quick    # smoke run, small tables
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch, torch.Tensor], None]


@dataclass(frozen=True)
class Config:
    name: str
    num_tables: int
    rows: int
    dim: int
    batch: int = 4096
    ids_per_bag: int = 20


CONFIGS = {
    "A": Config("A", 8, 1_000_000, 64),
    "B": Config("B", 26, 100_000, 128),
}
QUICK = {
    "A": Config("A", 8, 100_000, 64, batch=1024),
    "B": Config("B", 26, 10_000, 128, batch=1024),
}
RECOPT_OPTIMIZERS = ["sgd", "adagrad", "row_wise_adagrad", "adam", "row_wise_adam", "adafactor"]
FBGEMM_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "row_wise_adagrad": "EXACT_ROWWISE_ADAGRAD",
}
# State floats per touched row, for the bytes-moved count (adafactor: its row statistic).
STATE_PER_ROW = {
    "sgd": 0,
    "adagrad": 1,
    "row_wise_adagrad": 0,
    "adam": 2,
    "row_wise_adam": 1,
    "adafactor": 0,
}
STATE_SCALAR_PER_ROW = {"row_wise_adagrad": 1, "row_wise_adam": 1, "adafactor": 1}


def make_batches(cfg: Config, count: int, seed: int = 0) -> list[Batch]:
    """Uniform ids (every row equally likely), fixed bag length, KJT layout."""
    gen = torch.Generator().manual_seed(seed)
    n = cfg.num_tables * cfg.batch * cfg.ids_per_bag
    offsets = torch.arange(0, n + 1, cfg.ids_per_bag, dtype=torch.int64)
    return [(torch.randint(0, cfg.rows, (n,), generator=gen), offsets) for _ in range(count)]


def bandwidths(cfg: Config, batches: list[Batch]) -> tuple[float, float]:
    """(memory copy GB/s, random-row gather GB/s of rows read) on one table of this config."""
    table = torch.randn(cfg.rows, cfg.dim)
    dst = torch.empty_like(table)
    ids = batches[0][0][: cfg.batch * cfg.ids_per_bag]
    out = torch.empty(ids.numel(), cfg.dim)
    copy_s, gather_s = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(table)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.index_select(table, 0, ids, out=out)
        gather_s.append(time.perf_counter() - t0)
    copy_gbs = 2 * table.numel() * 4 / min(copy_s) / 1e9  # read + write
    gather_gbs = out.numel() * 4 / statistics.median(gather_s) / 1e9
    return copy_gbs, gather_gbs


def bytes_moved(cfg: Config, batch: Batch, optimizer: str) -> float:
    """Forward rows read, plus distinct rows (weights and state) read and written in backward."""
    ids, _ = batch
    per_table = cfg.batch * cfg.ids_per_bag
    distinct = sum(
        torch.unique(ids[t * per_table : (t + 1) * per_table]).numel()
        for t in range(cfg.num_tables)
    )
    row = cfg.dim * 4
    state = STATE_PER_ROW[optimizer] * row + STATE_SCALAR_PER_ROW.get(optimizer, 0) * 4
    return ids.numel() * row + distinct * 2 * (row + state)


def recopt_kernel(cfg: Config, optimizer: str) -> Step:
    tables = [
        TableSpec(name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim)
        for i in range(cfg.num_tables)
    ]
    kernel = RecoptTableBatchedEmbedding(
        tables,
        list(range(cfg.num_tables)),
        FusedOptimizerConfig(name=optimizer),
        PoolingType.SUM,
        torch.device("cpu"),
    )

    def step(batch: Batch, grad: torch.Tensor) -> None:
        kernel(*batch).backward(grad)

    return step


def fbgemm_kernel(cfg: Config, optimizer: str) -> Step:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    spec = (cfg.rows, cfg.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [spec] * cfg.num_tables,
        optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer]),
        learning_rate=0.01,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
    )

    def step(batch: Batch, grad: torch.Tensor) -> None:
        tbe(*batch).backward(grad)

    return step


def fused_collection(cfg: Config, optimizer: str, backend: str = "auto") -> Step:
    from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from recopt.sparse import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(cfg.num_tables)]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim, feature_names=(keys[i],)
        )
        for i in range(cfg.num_tables)
    ]
    config = FusedOptimizerConfig(name=optimizer, backend=Backend(backend))
    module = FusedEmbeddingBagCollection(tables, config)
    lengths = torch.full((cfg.num_tables * cfg.batch,), cfg.ids_per_bag, dtype=torch.int64)

    def step(batch: Batch, grad: torch.Tensor) -> None:
        kjt = KeyedJaggedTensor(keys, batch[0], lengths=lengths, stride=cfg.batch)
        module(kjt).values().backward(grad)

    return step


def torch_sparse(cfg: Config, optimizer: str) -> Step:
    bags = nn.ModuleList(
        nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True) for _ in range(cfg.num_tables)
    )
    params = list(bags.parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.SparseAdam(params, lr=0.001)
        if optimizer == "adam"
        else torch.optim.Adagrad(params, lr=0.01)
    )
    per_table = cfg.batch * cfg.ids_per_bag

    def step(batch: Batch, grad: torch.Tensor) -> None:
        ids, offsets = batch
        outs = [
            bag(ids[t * per_table : (t + 1) * per_table], offsets[: cfg.batch])
            for t, bag in enumerate(bags)
        ]
        torch.cat(outs, dim=1).backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def candidates(cfg: Config) -> list[tuple[str, str, Callable[[], Step]]]:
    """(label, optimizer, builder) for every candidate, built one at a time to bound memory."""
    out: list[tuple[str, str, Callable[[], Step]]] = []
    for name in RECOPT_OPTIMIZERS:
        out.append((f"recopt {name}", name, lambda n=name: recopt_kernel(cfg, n)))  # type: ignore[misc]
    for name in FBGEMM_OPTIMIZERS:
        out.append((f"fbgemm {name}", name, lambda n=name: fbgemm_kernel(cfg, n)))  # type: ignore[misc]
    for name, backend in (
        ("row_wise_adagrad", "auto"),
        ("row_wise_adagrad", "recopt"),
        ("adam", "auto"),
    ):
        label = f"FusedEBC {name} ({backend})"
        out.append((label, name, lambda n=name, b=backend: fused_collection(cfg, n, b)))  # type: ignore[misc]
    out.append(("torch SparseAdam", "adam", lambda: torch_sparse(cfg, "adam")))
    out.append(("torch Adagrad (sparse)", "adagrad", lambda: torch_sparse(cfg, "adagrad")))
    return out


def time_steps(
    step: Step, batches: list[Batch], grad: torch.Tensor, steps: int
) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds) per step, after one warm-up step."""
    step(batches[0], grad)  # warm-up: first touch of state, native library load
    walls, cpus = [], []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step(batches[(i + 1) % len(batches)], grad)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def run_config(cfg: Config, rounds: int, steps: int) -> list[str]:
    batches = make_batches(cfg, 3)
    grad = torch.randn(cfg.batch, cfg.num_tables * cfg.dim)
    copy_gbs, gather_gbs = bandwidths(cfg, batches)
    results: dict[str, list[tuple[float, float]]] = {}
    failures: dict[str, str] = {}
    for _ in range(rounds):  # rounds interleave the candidates, so load drifts hit all alike
        for label, _, build in candidates(cfg):
            if label in failures:
                continue
            try:
                step = build()
                results.setdefault(label, []).append(time_steps(step, batches, grad, steps))
            except (ImportError, RuntimeError, ValueError) as err:
                failures[label] = f"{type(err).__name__}: {str(err)[:60]}"
            step = None  # type: ignore[assignment]
            gc.collect()
    return format_table(cfg, results, failures, batches[0], copy_gbs, gather_gbs)


def format_table(
    cfg: Config,
    results: dict[str, list[tuple[float, float]]],
    failures: dict[str, str],
    batch: Batch,
    copy_gbs: float,
    gather_gbs: float,
) -> list[str]:
    def wall(label: str) -> float:
        return statistics.median(w for w, _ in results.get(label, [(float("nan"), 0.0)]))

    base, adam_ref = wall("fbgemm row_wise_adagrad"), wall("torch SparseAdam")
    lines = [
        f"config {cfg.name}: {cfg.num_tables} tables x {cfg.rows} rows x dim {cfg.dim}, "
        f"batch {cfg.batch}, {cfg.ids_per_bag} uniform ids per bag, sum pooling, "
        f"{torch.get_num_threads()} threads",
        f"memory copy {copy_gbs:.1f} GB/s, random-row gather {gather_gbs:.1f} GB/s (rows read)",
        "| candidate | ms/step | CPU ms/step | samples/s | vs fbgemm rw-adagrad | vs SparseAdam "
        "| eff. GB/s | floor / time | opt. state MB/table |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, _, _ in candidates(cfg):
        optimizer = next(o for lab, o, _ in candidates(cfg) if lab == label)
        state_mb = optimizer_state_floats(optimizer, cfg.rows, cfg.dim) * 4 / 2**20
        if label in failures:
            lines.append(f"| {label} | failed: {failures[label]} | | | | | | | {state_mb:.1f} |")
            continue
        seconds = wall(label)
        cpu = statistics.median(c for _, c in results[label])
        moved = bytes_moved(cfg, batch, optimizer)
        floor = moved / (gather_gbs * 1e9)
        lines.append(
            f"| {label} | {seconds * 1e3:.1f} | {cpu * 1e3:.1f} | {cfg.batch / seconds:,.0f} "
            f"| {base / seconds:.2f}x | {adam_ref / seconds:.2f}x | {moved / seconds / 1e9:.1f} "
            f"| {floor / seconds:.0%} | {state_mb:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small tables, one round: a smoke run")
    parser.add_argument("--configs", default="A,B", help="comma-separated subset of A,B")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per candidate")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    table = QUICK if args.quick else CONFIGS
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    for name in args.configs.split(","):
        for line in run_config(table[name.strip()], rounds, steps):
            print(line)
        print()


if __name__ == "__main__":
    main()
