"""Id maps (issue 26): the remap's cost next to the fused embedding step, and its ids/s.

Criteo-shaped tables (26 x rows x 64, batch 2048, one id per bag, row-wise Adagrad) fed raw
ids from a drifting power law over 2^40 ids. Three candidates measured interleaved, in one
process, after a warm-up that fills the maps (so evictions happen): the fused step (forward +
backward) with ids taken modulo the rows, the same step with `id_map` (lru), and the remap
alone (every table's map stepped on the same batch), native and torch ops (the torch maps
take the native maps' state after the warm-up: the two paths' states are equal). Prints
medians and the ratios to the modulo step.

    python benchmarks/bench_id_map.py                  # 26 x 100k rows
    python benchmarks/bench_id_map.py --rows 10000 --steps 5 --warmup 10
    python benchmarks/bench_id_map.py --threads 1      # less sensitive to a loaded machine
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map_lookup import IdMaps, hash_uniform
from recopt.modules.id_map_native import remap_tables
from recopt.sparse import KeyedJaggedTensor

NUM_TABLES, DIM, BATCH = 26, 64, 2048
CANDIDATES = ("modulo step", "id_map step", "remap native", "remap torch")


def _tables(rows: int, id_map: IdMapConfig | None) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rows,
            embedding_dim=DIM,
            feature_names=(f"f{i}",),
            id_map=id_map,
        )
        for i in range(NUM_TABLES)
    ]


def _raw_ids(rows: int, step: int, gen: torch.Generator) -> torch.Tensor:
    """[tables * batch] raw ids: a power law over 4x the rows whose popular set moves by
    rows/50 ids per step, scattered over 2^40 by a hash."""
    rank = (torch.rand(NUM_TABLES * BATCH, generator=gen) ** 3 * 4 * rows).long()
    drifted = rank + step * (rows // 50)
    unit = hash_uniform(drifted, 0, 1).squeeze(1)
    return (unit * 2**40).long()


def _kjt(values: torch.Tensor) -> KeyedJaggedTensor:
    lengths = torch.ones(NUM_TABLES * BATCH, dtype=torch.int64)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    return KeyedJaggedTensor(keys, values, lengths=lengths, stride=BATCH)


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.01)
    modulo = FusedEmbeddingBagCollection(_tables(args.rows, None), optimizer=optimizer)
    mapped_tables = _tables(args.rows, IdMapConfig(policy="lru"))
    mapped = FusedEmbeddingBagCollection(mapped_tables, optimizer=optimizer)
    alone, alone_torch = IdMaps(mapped_tables, "cpu"), IdMaps(mapped_tables, "cpu")
    names = [t.name for t in mapped_tables]
    for name in names:
        alone_torch.table_map(name).native = False  # the torch ops (the reference)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {key: [] for key in CANDIDATES}
    for step in range(args.warmup + args.steps):
        raw = _raw_ids(args.rows, step, gen)
        parts = raw.split(BATCH)

        def remap_all(maps: IdMaps, parts: tuple[torch.Tensor, ...] = parts) -> None:
            # as IdMaps.remap does: the native lru maps in one call
            tables = {name: maps.table_map(name) for name in names}
            remap_tables(tables, dict(zip(names, parts, strict=True)), True)

        if step == args.warmup:
            alone_torch.load_state_dict(alone.state_dict())
        measured = {
            "modulo step": _timed(
                lambda raw=raw: modulo(_kjt(raw % args.rows)).values().sum().backward()
            ),
            "id_map step": _timed(lambda raw=raw: mapped(_kjt(raw)).values().sum().backward()),
            "remap native": _timed(lambda: remap_all(alone)),
        }
        if step >= args.warmup:
            measured["remap torch"] = _timed(lambda: remap_all(alone_torch))
        if step >= args.warmup:
            for key, value in measured.items():
                times[key].append(value)
    stats = mapped.stats()
    occupancy = statistics.mean(s["occupancy"] for s in stats.values())
    evictions = statistics.mean(s["evictions"] for s in stats.values())
    base = statistics.median(times["modulo step"])
    print(
        f"{NUM_TABLES} tables x {args.rows} rows x {DIM}, batch {BATCH}, one id per bag, "
        f"{torch.get_num_threads()} threads"
    )
    for key, values in times.items():
        median = statistics.median(values)
        print(f"{key:24s} {median * 1e3:8.2f} ms  {median / base:6.3f}x of the modulo step")
    for key in ("remap native", "remap torch"):
        remap = statistics.median(times[key])
        print(f"{key}: {NUM_TABLES * BATCH / remap / 1e6:.2f} M ids/s")
    print(f"last step: occupancy {occupancy:.3f}, evictions per table {evictions:.0f}")


if __name__ == "__main__":
    main()
