"""lfu's victims on large tables (issue 26): the native map's rows in buckets by key against one
read of every row's key a step, side by side, per table size.

One native lfu map (default decay) per size, fed one table's share of the drifting stream
(2,048 ids a step, about a third new) until full, then timed over ``--steps`` steps; the same
map is built twice, once keeping its rows in buckets and once reading every key (the choice
`cpu_id_map.lfu_buckets_min_rows` makes by size), the steps interleaved. Prints the median
step of each, the ratio, and which way the default takes at that size.

    python benchmarks/bench_id_map_lfu.py                       # 250k, 500k, 1M, 4M rows
    python benchmarks/bench_id_map_lfu.py --rows 100000 8000000 --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_id_map import BATCH, stream_batches

from recopt.kernels import cpu_id_map
from recopt.modules import IdMapConfig
from recopt.modules.id_map import IdMap

WAYS = {"buckets": 0, "every row": 2**62}  # lfu_buckets_min_rows for each way


def measure(rows: int, steps: int) -> dict[str, float]:
    """Median milliseconds a step of each way, after the maps fill (their native cache is
    built at their first step, under the way's setting)."""
    maps: dict[str, IdMap] = {}
    for way in WAYS:
        was = cpu_id_map.lfu_buckets_min_rows(WAYS[way])
        try:
            maps[way] = IdMap(IdMapConfig(policy="lfu"), rows)
            batch = stream_batches("drifting", rows)
            step = 0
            while maps[way].last_stats is None or maps[way].last_stats.occupancy < 1.0:
                maps[way].remap(batch(step)[:BATCH], True)
                step += 1
        finally:
            cpu_id_map.lfu_buckets_min_rows(was)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(steps):
        ids = batch(step + i)[:BATCH]
        for way, idmap in maps.items():
            start = time.perf_counter()
            idmap.remap(ids, True)
            times[way].append(time.perf_counter() - start)
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = [250_000, 500_000, 10**6, 4 * 10**6]
    parser.add_argument("--rows", type=int, nargs="+", default=sizes)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    if not cpu_id_map.available():
        raise SystemExit("no C compiler: the native id map is not built")
    torch.set_num_threads(1)
    default = cpu_id_map.lfu_buckets_min_rows()
    print("| rows | buckets ms / step | every row ms / step | every row / buckets | default |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for rows in args.rows:
        ms = measure(rows, args.steps)
        way = "buckets" if rows >= default else "every row"
        ratio = ms["every row"] / ms["buckets"]
        print(f"| {rows:,} | {ms['buckets']:.3f} | {ms['every row']:.3f} | {ratio:.2f}x | {way} |")


if __name__ == "__main__":
    main()
