"""Checkpoint benchmarks: save/load throughput against a plain copy, and recopt-reshard's memory.

    .venv/bin/python benchmarks/bench_checkpoint.py               # defaults below
    .venv/bin/python benchmarks/bench_checkpoint.py --tables 8 --rows 262144 --dim 64

Throughput: one process saves a model of ``--tables`` float32 tables with Adam state (weight +
2 states each) with `recopt.checkpoint.save` (DCP, fsync, CRC-32, manifest, rename) and loads it
back with `load` (verification included); the baseline writes the same bytes to one file on
the same disk with fsync, and reads them back into preallocated tensors. Best of ``--repeat``.

Reshard memory: 2 spawned ranks save the tables row-wise as ShardedTensors; ``recopt-reshard
--world-size 3`` runs as a child process and its peak RSS (``wait4``) minus the peak RSS of a
child that only imports the same modules is compared with the largest table's weight + state.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from recopt.checkpoint import load, save
from recopt.testing import run_on_ranks


class Tables(torch.nn.Module):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rows, dim)) for _ in range(tables)
        )


def _with_adam_state(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _drop_cache(path: Path) -> None:
    """Evict ``path``'s (clean, fsynced) pages from the page cache: the next read hits the disk."""
    files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_copy(tensors: list[torch.Tensor], file: Path, cold: bool) -> tuple[float, float]:
    start = time.perf_counter()
    with open(file, "wb") as f:
        for t in tensors:
            f.write(t.numpy().data)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    targets = [torch.empty_like(t) for t in tensors]  # faulted in while reading, as load's
    if cold:
        _drop_cache(file)
    start = time.perf_counter()
    with open(file, "rb", buffering=0) as f:
        for t in targets:
            f.readinto(t.numpy().data)  # type: ignore[attr-defined]
    read_s = time.perf_counter() - start
    file.unlink()
    return write_s, read_s


def throughput(args: argparse.Namespace, root: Path, cold: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tables(args.tables, args.rows, args.dim)
    opt = _with_adam_state(model)
    tensors = [p.detach() for p in model.parameters()]
    tensors += [s for p in model.parameters() for s in opt.state[p].values() if s.dim() > 0]
    nbytes = sum(t.nbytes for t in tensors)
    samples: dict[str, list[float]] = {"copy_w": [], "copy_r": [], "save": [], "load": []}
    for _ in range(args.repeat):
        copy_w, copy_r = _plain_copy(tensors, root / "plain.bin", cold)
        start = time.perf_counter()
        save(root / "ck", model, opt, step=1)
        save_s = time.perf_counter() - start
        fresh = Tables(args.tables, args.rows, args.dim)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        if cold:
            _drop_cache(root / "ck")
        start = time.perf_counter()
        load(root / "ck", fresh, fresh_opt)
        load_s = time.perf_counter() - start
        shutil.rmtree(root / "ck")
        for key, value in zip(samples, (copy_w, copy_r, save_s, load_s), strict=True):
            samples[key].append(value)
    gib = nbytes / (1 << 30)
    result: dict[str, Any] = {"bench": "throughput" + ("_cold" if cold else ""), "bytes": nbytes}
    # The disk and CPUs may be shared: report the best and the median of interleaved runs.
    for stat, pick in (("best", min), ("median", statistics.median)):
        t = {k: pick(v) for k, v in samples.items()}
        result[stat] = {
            "save_gib_s": round(gib / t["save"], 3),
            "plain_write_gib_s": round(gib / t["copy_w"], 3),
            "save_vs_plain": round(t["copy_w"] / t["save"], 3),
            "load_gib_s": round(gib / t["load"], 3),
            "plain_read_gib_s": round(gib / t["copy_r"], 3),
            "load_vs_plain": round(t["copy_r"] / t["load"], 3),
        }
    return result


def _save_row_wise(rank: int, world: int, root: str, tables: int, rows: int, dim: int) -> None:
    per = rows // world

    def sharded(seed: int, shape: tuple[int, ...]) -> ShardedTensor:
        g = torch.Generator().manual_seed(seed * world + rank)
        local = torch.randn((per, *shape[1:]), generator=g)
        offsets = [rank * per] + [0] * (len(shape) - 1)
        md = ShardMetadata(offsets, list(local.shape), f"rank:{rank}/cpu")
        return ShardedTensor._init_from_local_shards([Shard(local, md)], list(shape))

    class Holder(torch.nn.Module):
        def state_dict(self, *a: Any, **k: Any) -> dict[str, Any]:  # type: ignore[override]
            out = {}
            for t in range(tables):
                out[f"ebc.embedding_bags.t{t}.weight"] = sharded(3 * t, (rows, dim))
                out[f"ebc.embedding_bags.t{t}.exp_avg"] = sharded(3 * t + 1, (rows, dim))
                out[f"ebc.embedding_bags.t{t}.exp_avg_sq"] = sharded(3 * t + 2, (rows, dim))
            return out

    save(Path(root) / "src", Holder())


# Runs the CLI (or only its imports) and reports this process's own peak RSS (VmHWM, reset at
# exec; ru_maxrss of a child would include its parent's RSS at fork time).
_CHILD = """
import sys
from recopt.checkpoint.cli import main
rc = main(sys.argv[1:]) if len(sys.argv) > 1 else 0
status = open("/proc/self/status").read()
print("VmHWM_KiB", int(status.split("VmHWM:")[1].split()[0]), file=sys.stderr)
sys.exit(rc)
"""


def _peak_rss_mib(args: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"recopt-reshard {args} failed: {done.stderr[-2000:]}")
    line = [x for x in done.stderr.splitlines() if x.startswith("VmHWM_KiB")][-1]
    return int(line.split()[1]) / 1024, time.perf_counter() - start


def reshard_memory(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_on_ranks(_save_row_wise, 2, str(root), args.tables, args.rows, args.dim, timeout_s=600)
    table_mib = 3 * args.rows * args.dim * 4 / (1 << 20)  # weight + 2 states
    baseline, _ = _peak_rss_mib([])
    peak, seconds = _peak_rss_mib(
        [str(root / "src"), str(root / "dst"), "--world-size", "3", "--quiet"]
    )
    return {
        "bench": "reshard_memory",
        "model_mib": args.tables * table_mib,
        "largest_table_mib": table_mib,
        "baseline_rss_mib": baseline,
        "peak_rss_mib": peak,
        "peak_over_baseline_mib": peak - baseline,
        "ratio_to_largest_table": (peak - baseline) / table_mib,
        "seconds": seconds,
    }


def _id_tables(tables: int, rows: int, dim: int) -> list[Any]:
    from bench_id_map import bench_tables  # a sibling script (run from benchmarks/ or as a file)

    from recopt.modules import IdMapConfig

    return bench_tables(rows, IdMapConfig(policy="lru"), count=tables, dim=dim)


def _save_id_mapped(rank: int, world: int, root: str, tables: int, rows: int, dim: int) -> None:
    """Saves id-mapped tables row-wise with Adam state, every row holding a distinct id."""
    from recopt.kernels.config import FusedOptimizerConfig
    from recopt.sharding import construct_module_sharding_plan, row_wise
    from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection

    configs = _id_tables(tables, rows, dim)
    plan = construct_module_sharding_plan(configs, {t.name: row_wise() for t in configs}, world)
    optimizer = FusedOptimizerConfig(name="adam", lr=0.01, backend="recopt")
    ebc = ShardedEmbeddingBagCollection(configs, plan, optimizer=optimizer)
    maps = ebc.id_maps
    assert maps is not None
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for t in configs:
            idmap = maps.table_map(t.name)
            n = idmap.num_rows
            idmap.buffer("row_ids").copy_(torch.randperm(n, generator=g) * world + rank)
            idmap.buffer("occupied").fill_(True)
            idmap.buffer("last_seen").copy_(torch.randint(0, 100, (n,), generator=g))
            idmap.buffer("frequency").copy_(torch.rand(n, generator=g, dtype=torch.float64))
            idmap.buffer("step").fill_(100)
        for states in ebc.fused_optimizer.state_dict()["state"].values():
            for value in states.values():
                for shard in getattr(value, "local_shards", list)():
                    shard.tensor.uniform_(generator=g)
    save(Path(root) / "src", ebc, {"fused": ebc.fused_optimizer})


def reshard_id_map_memory(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Peak RSS of recopt-reshard 2 -> 3 ranks of id-mapped tables, without a plan (rows
    stay) and with the plan and config (every id placed on its owner shard), side by side."""
    from recopt.sharding import ShardingPlan, construct_module_sharding_plan, row_wise

    size = (args.tables, args.rows, args.dim)
    run_on_ranks(_save_id_mapped, 2, str(root), *size, timeout_s=600)
    configs = _id_tables(*size)
    plan = construct_module_sharding_plan(configs, {t.name: row_wise() for t in configs}, 3)
    (root / "plan.json").write_text(ShardingPlan({"": plan}).to_json())
    toml = "".join(
        f'[[embedding.tables]]\nname = "{t.name}"\nnum_embeddings = {args.rows}\n'
        f'embedding_dim = {args.dim}\nfeature_names = ["{t.feature_names[0]}"]\n'
        'id_map = { policy = "lru" }\n\n'
        for t in configs
    )
    (root / "model.toml").write_text(toml)
    table_mib = (3 * args.rows * args.dim * 4 + args.rows * 25) / (1 << 20)
    baseline, _ = _peak_rss_mib([])
    out: dict[str, Any] = {"bench": "reshard_id_map_memory", "largest_table_mib": table_mib}
    placing = ["--plan", str(root / "plan.json"), "--config", str(root / "model.toml")]
    for name, extra in (("rows_stay", []), ("ids_placed", placing)):
        peak, seconds = _peak_rss_mib(
            [str(root / "src"), str(root / name), "--world-size", "3", "--quiet", *extra]
        )
        out[f"{name}_ratio_to_largest_table"] = round((peak - baseline) / table_mib, 3)
        out[f"{name}_seconds"] = round(seconds, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=6)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--id-map", action="store_true", help="only recopt-reshard's memory on id-mapped tables"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="recopt-bench-ckpt-", dir=args.dir) as tmp:
        benches = [throughput, lambda a, r: throughput(a, r, cold=True), reshard_memory]
        if args.id_map:
            benches = [reshard_id_map_memory]
        for bench in benches:
            print(json.dumps(bench(args, Path(tmp))), flush=True)
            for child in Path(tmp).iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
