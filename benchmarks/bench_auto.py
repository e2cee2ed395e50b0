"""Backend.AUTO against both backends it chooses between, in one run (issue 14).

For each config, three kernels from `create_kernel` (backend fbgemm, recopt and auto) run
forward + backward + fused update on the same batches, interleaved step by step (the order
rotating each step); the table
reports the median ms/step and AUTO / faster backend. AUTO resolves with an empty cache
directory (its first-resolution time is reported, then a cache hit from a new resolver).

    python benchmarks/bench_auto.py                 # configs A, B, criteo (a few minutes)
    python benchmarks/bench_auto.py --quick         # smoke run, small tables
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from recopt.kernels.autotune import AutoConfig, AutoResolver, configure_auto
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import create_kernel, resolve_backend


@dataclass(frozen=True)
class Config:
    name: str
    num_tables: int
    rows: int
    dim: int
    batch: int
    ids_per_bag: int


CONFIGS = {
    "A": Config("A", 8, 1_000_000, 64, 4096, 20),
    "B": Config("B", 26, 100_000, 128, 4096, 20),
    # configs/dlrm_criteo_shape.toml: 26 tables x 100k x 64, batch 2048, one id per bag.
    "criteo": Config("criteo", 26, 100_000, 64, 2048, 1),
}
QUICK = {
    "A": Config("A", 8, 100_000, 64, 1024, 20),
    "B": Config("B", 26, 10_000, 128, 1024, 20),
    "criteo": Config("criteo", 26, 10_000, 64, 1024, 1),
}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?")


def run_config(cfg: Config, optimizer: str, steps: int, cache_dir: Path) -> list[str]:
    tables = [
        TableSpec(name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim)
        for i in range(cfg.num_tables)
    ]
    fmap = list(range(cfg.num_tables))
    cpu = torch.device("cpu")
    configure_auto(AutoResolver(AutoConfig(cache_dir=cache_dir)))
    auto_cfg = FusedOptimizerConfig(name=optimizer)
    t0 = time.perf_counter()
    decision = resolve_backend(tables, auto_cfg, cpu, fmap)  # the measurement, empty cache
    first = time.perf_counter() - t0
    configure_auto(AutoResolver(AutoConfig(cache_dir=cache_dir)))  # a 'new process'
    t0 = time.perf_counter()
    again = resolve_backend(tables, auto_cfg, cpu, fmap)
    second = time.perf_counter() - t0
    kernels = {}
    for backend in (Backend.FBGEMM, Backend.RECOPT):
        opt = FusedOptimizerConfig(name=optimizer, backend=backend)
        kernels[backend.value] = create_kernel(tables, fmap, opt, PoolingType.SUM, cpu)
    kernels["auto"] = create_kernel(tables, fmap, auto_cfg, PoolingType.SUM, cpu)
    gen = torch.Generator().manual_seed(0)
    n = cfg.num_tables * cfg.batch * cfg.ids_per_bag
    offsets = torch.arange(0, n + 1, cfg.ids_per_bag, dtype=torch.int64)
    batches = [(torch.randint(0, cfg.rows, (n,), generator=gen), offsets) for _ in range(3)]
    grad = torch.randn(cfg.batch, cfg.num_tables * cfg.dim)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    labels = list(kernels)
    for i in range(steps + 1):  # step 0 warms up every kernel
        # Rotate the order each step: a kernel can slow the one that runs right after it
        # (threads still spinning, caches), which must not always hit the same candidate.
        for label in labels[i % 3 :] + labels[: i % 3]:
            kernel = kernels[label]
            start = time.perf_counter()
            kernel(*batches[i % len(batches)]).backward(grad)
            if i > 0:
                times[label].append(time.perf_counter() - start)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    faster = min(ms["fbgemm"], ms["recopt"])
    probe = ", ".join(f"{b} {s * 1e3:.2f} ms" for b, s in decision.seconds.items())
    return [
        f"config {cfg.name}: {cfg.num_tables} x {cfg.rows} x {cfg.dim}, batch {cfg.batch}, "
        f"{cfg.ids_per_bag} ids/bag, {optimizer}, {torch.get_num_threads()} threads, "
        f"{steps} interleaved steps (median)",
        f"| {cfg.name} | {ms['fbgemm']:.1f} | {ms['recopt']:.1f} | {ms['auto']:.1f} "
        f"| {decision.backend.value} | {faster / ms['auto']:.2f}x "
        f"| {ms['fbgemm'] / ms['auto']:.2f}x "
        f"| {first:.2f} s ({decision.reason}: {probe}) | {second * 1e3:.0f} ms ({again.reason}) |",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small tables: a smoke run")
    parser.add_argument("--configs", default="A,B,criteo", help="subset of A,B,criteo")
    parser.add_argument("--optimizer", default="row_wise_adagrad")
    parser.add_argument("--steps", type=int, default=9, help="interleaved timed steps")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = QUICK if args.quick else CONFIGS
    print(f"CPU: {cpu_model()}; load average before: {os.getloadavg()}")
    rows = []
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory(prefix="recopt-auto-") as cache_dir:
            lines = run_config(table[name.strip()], args.optimizer, args.steps, Path(cache_dir))
        print(lines[0])
        rows.append(lines[1])
        gc.collect()
    print(
        "| config | fbgemm ms | recopt ms | AUTO ms | AUTO chose | AUTO / faster "
        "| AUTO vs fbgemm | first resolution | cache hit |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |")
    for row in rows:
        print(row)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
