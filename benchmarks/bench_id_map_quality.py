"""Quality of id-mapped tables against modulo hashing, same row budget, on drifting ids.

    python benchmarks/bench_id_map_quality.py           # every variant; seeds 0, 1
    python benchmarks/bench_id_map_quality.py --variants lru modulo --seeds 0 \
        --set training.steps=300

Trains the DLRM script (examples/dlrm/train.py, one process) on configs/dlrm_id_map.toml: the
synthetic click log with ``id_space = "drifting"`` (raw ids of a power law over 2**40 ids
whose popular set moves; labels follow each raw id's planted effect). Each variant has the
same tables (rows, dim), data, seeds and steps; only how ids reach rows differs:
``lru`` / ``lfu``: an id map per table (every live id its own row, eviction by policy);
``lru_admit2``: lru, an id admitted once seen twice (one-off ids read the zero row);
``modulo``: no id map, the data folds raw ids into the table (``raw % rows``: collisions).
Each (variant, seed) pair sets the stream's and the model's seed (``data.synthetic.seed``,
``training.seed``; the hidden model stays). Validation: the script's own, on
``data.val_batches`` (32 here) held-out batches at the final step's drift clock.
Reports the final validation AUC, NE and loss and, for id maps, each table's occupancy and
new ids and evictions per step (means over the last logging window), as one JSON line per
run, then a table of the means over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

from dlrm_config import TrainingConfig, load_config  # noqa: E402
from train import RunEnv, train  # noqa: E402

from recopt.modules import IdMapConfig  # noqa: E402

CONFIG = ROOT / "configs" / "dlrm_id_map.toml"
VARIANTS = {
    "lru": IdMapConfig(policy="lru"),
    "lfu": IdMapConfig(policy="lfu"),
    "lru_admit2": IdMapConfig(policy="lru", admit_after=2),
    "modulo": None,
}


def with_id_map(config: TrainingConfig, id_map: IdMapConfig | None) -> TrainingConfig:
    """``config`` with every table's ``id_map`` (and the section's) set to ``id_map``."""
    tables = tuple(dataclasses.replace(t, id_map=id_map) for t in config.embedding.tables)
    embedding = dataclasses.replace(config.embedding, tables=tables, id_map=id_map)
    return dataclasses.replace(config, embedding=embedding)


def run_variant(name: str, seed: int, overrides: list[str], out: pathlib.Path) -> dict[str, Any]:
    """Trains one variant; returns its final validation and id-map figures."""
    out = out / f"{name}_{seed}"
    settings = [
        f"training.output_dir={out}",
        "training.plot=false",
        "checkpoint.every=0",
        "data.val_batches=32",
        f"data.synthetic.seed={seed}",
        f"training.seed={seed}",
        *overrides,
    ]
    config = with_id_map(load_config(str(CONFIG), settings), VARIANTS[name])
    start = time.perf_counter()
    val = train(config, RunEnv())
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in records if r["split"] == "train"][-1]
    tables = [t.name for t in config.embedding.tables]
    result: dict[str, Any] = {
        "variant": name,
        "seed": seed,
        "steps": config.training.steps,
        "val_auc": val.get("auc"),
        "val_ne": val.get("ne"),
        "val_loss": val.get("loss"),
        "wall_s": round(seconds, 1),
    }
    if VARIANTS[name] is not None:
        for stat in ("occupancy", "new_ids", "evictions", "zero_row_ids"):
            result[stat] = {t: round(last_train[f"id_map.{t}.{stat}"], 3) for t in tables}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in args.variants:
                overrides = ["training.num_threads=1", *args.set]
                result = run_variant(name, seed, overrides, pathlib.Path(tmp))
                print(json.dumps(result), flush=True)
                results.append(result)
    print(f"load average after: {os.getloadavg()}")
    print_table(results, args.variants)


def print_table(results: list[dict[str, Any]], variants: list[str]) -> None:
    """Means over the seeds per variant: AUC, NE, the lowest occupancy of a table, and new
    ids and evictions per step summed over the tables."""
    header = ("val AUC", 8), ("val NE", 8), ("occupancy", 10), ("new/step", 9), ("evict/step", 10)
    print(f"{'variant':8} " + " ".join(f"{text:>{width}}" for text, width in header))
    for name in variants:
        runs = [r for r in results if r["variant"] == name]
        auc = sum(r["val_auc"] for r in runs) / len(runs)
        ne = sum(r["val_ne"] for r in runs) / len(runs)
        occupancy = new = evictions = "-"
        if "occupancy" in runs[0]:
            occupancy = f"{min(min(r['occupancy'].values()) for r in runs):.2f}"
            new = f"{sum(sum(r['new_ids'].values()) for r in runs) / len(runs):.0f}"
            evictions = f"{sum(sum(r['evictions'].values()) for r in runs) / len(runs):.0f}"
        print(f"{name:8} {auc:8.4f} {ne:8.4f} {occupancy:>10} {new:>9} {evictions:>10}")


if __name__ == "__main__":
    main()
