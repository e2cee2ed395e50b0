"""DLRM training throughput, split by phase: data, forward, backward (+ fused update), optimizer.

    python benchmarks/bench_dlrm.py                       # small, criteo-64, criteo-128
    python benchmarks/bench_dlrm.py --configs criteo-64 --steps 30 --threads 1 2
    python benchmarks/bench_dlrm.py --profile criteo-64   # torch profiler table of one config

Builds the model and optimizers exactly as examples/dlrm/train.py does, on synthetic data.
Each phase is timed with perf_counter (CPU work is synchronous); medians over the timed steps.
The Criteo-shaped configs: 26 tables x 100k rows, one id per bag, batch 2048, bottom MLP
512-256-D, top MLP 512-256-1, row-wise Adagrad (sparse) + Adagrad (dense).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

from dlrm_config import TrainingConfig, load_config  # noqa: E402
from train import RunEnv, build_data, build_model, build_optimizer  # noqa: E402

CONFIGS: dict[str, tuple[str, list[str]]] = {
    "small": ("configs/dlrm_small.toml", []),
    "criteo-64": ("configs/dlrm_criteo_shape.toml", []),
    "criteo-128": (
        "configs/dlrm_criteo_shape.toml",
        ["model.bottom_mlp=[512, 256, 128]"]
        + [f"embedding.tables.{i}.embedding_dim=128" for i in range(26)],
    ),
}
PHASES = ("data", "forward", "backward", "optimizer")


def measure(config: TrainingConfig, steps: int, warmup: int) -> dict[str, Any]:
    """Trains ``warmup + steps`` steps; returns samples/s and the median time of each phase."""
    env = RunEnv()
    model = build_model(config, env.device)
    optimizer = build_optimizer(model, config)
    data = build_data(config, env, "train")
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    cpu_times: dict[str, list[float]] = {p: [] for p in PHASES}
    batch_size = config.data.batch_size
    wall = cpu = 0.0
    for step in range(warmup + steps):
        marks = [(time.perf_counter(), time.process_time())]
        batch = next(data)
        marks.append((time.perf_counter(), time.process_time()))
        logits = model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        marks.append((time.perf_counter(), time.process_time()))
        optimizer.zero_grad()
        loss.backward()
        marks.append((time.perf_counter(), time.process_time()))
        optimizer.step()
        marks.append((time.perf_counter(), time.process_time()))
        if step >= warmup:
            for i, phase in enumerate(PHASES):
                times[phase].append(marks[i + 1][0] - marks[i][0])
                cpu_times[phase].append(marks[i + 1][1] - marks[i][1])
            wall += marks[-1][0] - marks[0][0]
            cpu += marks[-1][1] - marks[0][1]
    medians = {p: statistics.median(v) * 1e3 for p, v in times.items()}
    cpu_means = {p: statistics.mean(v) * 1e3 for p, v in cpu_times.items()}
    return {
        "samples_per_s": batch_size * steps / wall,
        # On a shared machine wall time counts other processes' turns on the core; samples per
        # CPU-second of this process is what the code would do with the cores to itself.
        "samples_per_cpu_s": batch_size * steps / cpu,
        # Without the data phase: comparable with bench_dlrm_torchrec.py (batches made ahead).
        "model_samples_per_cpu_s": batch_size * steps / (cpu - sum(cpu_times["data"])),
        "median_step_samples_per_s": batch_size / (sum(medians.values()) / 1e3),
        "phase_ms": {p: round(v, 2) for p, v in medians.items()},
        "phase_cpu_ms": {p: round(v, 2) for p, v in cpu_means.items()},
        "batch_size": batch_size,
    }


def profile(config: TrainingConfig, steps: int) -> str:
    """A torch profiler table (self CPU time) of ``steps`` training steps."""
    from torch.profiler import profile as torch_profile

    env = RunEnv()
    model = build_model(config, env.device)
    optimizer = build_optimizer(model, config)
    data = build_data(config, env, "train")

    def step() -> None:
        batch = next(data)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    with torch_profile() as prof:
        for _ in range(steps):
            step()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--profile", choices=list(CONFIGS))
    parser.add_argument(
        "--matmul-precision",
        default="highest",
        choices=["highest", "high", "medium"],
        help="float32 matmul precision (medium: bfloat16 inside oneDNN where the CPU has it)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision(args.matmul_precision)
    if args.profile:
        torch.set_num_threads(args.threads[0])
        path, overrides = CONFIGS[args.profile]
        print(profile(load_config(str(ROOT / path), overrides), args.steps))
        return 0
    results = []
    for name in args.configs:
        path, overrides = CONFIGS[name]
        config = load_config(str(ROOT / path), overrides)
        for threads in args.threads:
            torch.set_num_threads(threads)
            result = {
                "config": name,
                "threads": threads,
                **measure(config, args.steps, args.warmup),
            }
            results.append(result)
            phases = " ".join(f"{p} {ms:.1f}" for p, ms in result["phase_ms"].items())
            cpu_phases = " ".join(f"{p} {ms:.1f}" for p, ms in result["phase_cpu_ms"].items())
            print(
                f"{name:11s} threads {threads}: {result['samples_per_s'] / 1e3:6.1f}k samples/s "
                f"wall (median step {result['median_step_samples_per_s'] / 1e3:.1f}k), "
                f"{result['samples_per_cpu_s'] / 1e3:.1f}k per CPU-s "
                f"({result['model_samples_per_cpu_s'] / 1e3:.1f}k without data) | "
                f"wall ms: {phases} | "
                f"CPU ms: {cpu_phases}",
                flush=True,
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
