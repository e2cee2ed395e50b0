"""Id maps (issue 26): the remap's cost next to the fused embedding step, per id stream.

Criteo-shaped tables (26 x rows x 64, batch 2048, one id per bag, row-wise Adagrad). Per
stream, in one process and interleaved step by step, after a warm-up that fills the maps (so
evictions happen): the fused step (forward + backward) with the raw ids modulo the rows, the
same step with `id_map`, and the remap alone (a second set of maps stepped on the same ids).
Optionally (``--torch-remap``) the remap in torch ops too, on maps that take the native maps'
state after the warm-up. Prints medians, the ratios to the modulo step and the churn (new ids
and evictions per table per step). ``--pipeline``: both steps in `TrainPipelineSparseDist`
instead (the id_map one remaps batch i+1 on its worker thread while batch i trains; each of
its steps timed until that worker is idle), in alternating blocks of ``--block`` steps (10:
each model's steps run back to back, as in training, so its hot rows, maps and worker state
stay in the caches from one step to the next; 1: step by step, each step after the other
model's, whose 665 MB of tables evict them: a cost no training run pays).

Streams (``--stream``, several run one after the other in one run):
  worst            a power law over 4x the rows whose popular set moves by rows/50 ids a step,
                   scattered over 2^40 by a hash: ~75% of each batch's ids are new (lru)
  drifting         the DLRM synthetic log's drifting id space (`recopt.data.synthetic`,
                   ``id_space = "drifting"``, every other setting its default), lru
  drifting-admit2  the same with ``admit_after = 2``
  drifting-lfu     the same with ``policy = "lfu"`` (default decay)

    python benchmarks/bench_id_map.py                       # every stream, 26 x 100k rows
    python benchmarks/bench_id_map.py --stream worst --threads 1
    python benchmarks/bench_id_map.py --rows 10000 --steps 5 --warmup 5
    python benchmarks/bench_id_map.py --pipeline --steps 200 --threads 1 [--block 1]
    python benchmarks/bench_id_map.py --device cuda [--pipeline --remap-threads 4]  # a GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from recopt.data.batch import Batch
from recopt.data.synthetic import SyntheticClickLog, SyntheticConfig
from recopt.kernels import cpu_id_map
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map_ahead import worker_busy_seconds
from recopt.modules.id_map_lookup import IdMaps
from recopt.modules.id_map_native import remap_tables
from recopt.modules.id_map_rows import hash_uniform
from recopt.sharding import TrainPipelineSparseDist
from recopt.sparse import KeyedJaggedTensor

NUM_TABLES, DIM, BATCH = 26, 64, 2048
CANDIDATES = ("modulo step", "id_map step", "remap native", "remap torch")
STREAMS = ("worst", "drifting", "drifting-admit2", "drifting-lfu")
_ID_MAPS = {
    "worst": IdMapConfig(policy="lru"),
    "drifting": IdMapConfig(policy="lru"),
    "drifting-admit2": IdMapConfig(policy="lru", admit_after=2),
    "drifting-lfu": IdMapConfig(policy="lfu"),
}


def bench_tables(
    rows: int, id_map: IdMapConfig | None, count: int = NUM_TABLES, dim: int = DIM
) -> list[EmbeddingBagConfig]:
    """``count`` tables ``t<i>`` of ``rows`` x ``dim``, one feature ``f<i>`` each."""
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=(f"f{i}",),
            id_map=id_map,
        )
        for i in range(count)
    ]


def worst_ids(
    rows: int, step: int, gen: torch.Generator, count: int = NUM_TABLES, batch: int = BATCH
) -> torch.Tensor:
    """[count * batch] raw ids of the worst stream: a power law over 4x the rows whose
    popular set moves by rows/50 ids per step, scattered over 2^40 by a hash."""
    rank = (torch.rand(count * batch, generator=gen) ** 3 * 4 * rows).long()
    drifted = rank + step * (rows // 50)
    unit = hash_uniform(drifted, 0, 1).squeeze(1)
    return (unit * 2**40).long()


def one_id_bags(
    values: torch.Tensor, count: int = NUM_TABLES, batch: int = BATCH
) -> KeyedJaggedTensor:
    """``values`` as ``count`` features ``f<i>`` of ``batch`` bags of one id each."""
    lengths = torch.ones(count * batch, dtype=torch.int64, device=values.device)
    keys = [f"f{i}" for i in range(count)]
    return KeyedJaggedTensor(keys, values, lengths=lengths, stride=batch)


def stream_batches(name: str, rows: int) -> Callable[[int], torch.Tensor]:
    """Batch ``step``'s raw ids ([tables * batch], feature after feature) of stream ``name``
    (call with steps 0, 1, 2, ... in order)."""
    if name == "worst":
        gen = torch.Generator().manual_seed(0)
        return lambda step: worst_ids(rows, step, gen)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    log = SyntheticClickLog(
        [(key, rows) for key in keys],
        SyntheticConfig(id_space="drifting"),
        BATCH,
        raw_features=keys,
    )
    return lambda step: log.generate(step)[1].values()


def _timed(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds ``fn`` takes; on CUDA from an idle device until its work is done."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclasses.dataclass
class StreamResult:
    """One stream's medians (seconds) by candidate and its churn per table per step."""

    stream: str
    times: dict[str, list[float]]
    new_ids: float
    evictions: float
    admissions: float
    occupancy: float
    warmup: int
    syncs: dict[str, float] = dataclasses.field(default_factory=dict)  # per step, on CUDA
    worker_s: float | None = None  # pipelined: the remap worker's busy time per id_map step

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])


def _syncs(steps: dict[str, Callable[[int], object]], device: str) -> dict[str, float]:
    """On CUDA: each candidate's host syncs per step over 3 steps (`bench_gpu.host_syncs`:
    stream/device syncs and blocking copies, which stop the host from queuing ahead)."""
    if torch.device(device).type != "cuda":
        return {}
    from bench_gpu import host_syncs

    return {key: host_syncs(step, 3)["syncs"] for key, step in steps.items()}


class _Setup:
    """The modules and maps of one stream."""

    def __init__(
        self, rows: int, id_map: IdMapConfig, torch_remap: bool, device: str = "cpu"
    ) -> None:
        torch.manual_seed(0)
        optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.01)
        self.rows = rows
        self.modulo = FusedEmbeddingBagCollection(
            bench_tables(rows, None), optimizer=optimizer, device=device
        )
        tables = bench_tables(rows, id_map)
        self.mapped = FusedEmbeddingBagCollection(tables, optimizer=optimizer, device=device)
        self.alone = IdMaps(tables, device)  # a CUDA table's maps: on the host
        self.alone_torch = IdMaps(tables, "cpu") if torch_remap else None
        if self.alone_torch is not None:
            for name in self.alone_torch:
                self.alone_torch.table_map(name).native = False  # the torch ops (reference)
        self.names = [t.name for t in tables]

    @staticmethod
    def step(module: FusedEmbeddingBagCollection, ids: torch.Tensor) -> Callable[[], object]:
        """Forward and backward (the fused update) of ``module`` on one batch."""
        kjt = one_id_bags(ids)
        return lambda: module(kjt).values().sum().backward()

    def remap_alone(self, maps: IdMaps, raw: torch.Tensor) -> Callable[[], object]:
        """As `IdMaps.remap` steps the maps (the native lru maps in one call)."""
        parts = dict(zip(self.names, raw.split(BATCH), strict=True))
        tables = {name: maps.table_map(name) for name in self.names}
        return lambda: remap_tables(tables, parts, True)

    def full(self) -> bool:
        return all(s["occupancy"] >= 1.0 for s in self.mapped.stats().values())


def measure(
    stream: str, rows: int, warmup: int, steps: int, torch_remap: bool, device: str = "cpu"
) -> StreamResult:
    """Warm up until the maps are full (at most 20x ``warmup`` steps), then ``warmup`` more
    steps, then ``steps`` measured steps, the candidates interleaved. On CUDA the modules and
    the ids live on the GPU, the maps on the host (`map_device`): "remap native" includes
    the ids' copy over and the rows' copy back."""
    setup = _Setup(rows, _ID_MAPS[stream], torch_remap and device == "cpu", device)
    batch = stream_batches(stream, rows)
    step, measured = 0, -warmup
    churn: list[dict[str, float]] = []
    times: dict[str, list[float]] = {
        key: [] for key in CANDIDATES if torch_remap or "torch" not in key
    }
    while measured < steps:
        raw = batch(step).to(device)
        timings = {
            "modulo step": _timed(setup.step(setup.modulo, raw % rows), device),
            "id_map step": _timed(setup.step(setup.mapped, raw), device),
            "remap native": _timed(setup.remap_alone(setup.alone, raw), device),
        }
        if measured == 0 and setup.alone_torch is not None:
            setup.alone_torch.load_state_dict(setup.alone.state_dict())
        if measured >= 0 and setup.alone_torch is not None:
            timings["remap torch"] = _timed(setup.remap_alone(setup.alone_torch, raw))
        step += 1
        if measured < 0 and not setup.full() and step < 20 * max(warmup, 1):
            continue  # filling the maps
        if measured >= 0:
            for key, value in timings.items():
                times[key].append(value)
            churn.append({k: float(v) for k, v in _mean_stats(setup).items()})
        measured += 1
    mean = {k: statistics.mean(c[k] for c in churn) for k in churn[0]}
    after = [batch(step + i).to(device) for i in range(3)]
    syncs = _syncs(
        {
            "modulo step": lambda i: setup.step(setup.modulo, after[i] % rows)(),
            "id_map step": lambda i: setup.step(setup.mapped, after[i])(),
        },
        device,
    )
    return StreamResult(
        stream, times, mean["new_ids"], mean["evictions"], mean["admissions"],
        mean["occupancy"], step - steps, syncs,
    )  # fmt: skip


def _mean_stats(setup: _Setup) -> dict[str, float]:
    stats = setup.mapped.stats()
    keys = ("new_ids", "evictions", "admissions", "occupancy")
    return {k: statistics.mean(s[k] for s in stats.values()) for k in keys}


def report(results: list[StreamResult], rows: int, device: str = "cpu") -> None:
    """Per stream: the candidates' medians and ratios, the churn; then one markdown table."""
    where = f"{torch.get_num_threads()} threads"
    if device != "cpu":
        where = f"{torch.cuda.get_device_name(device)} (maps on the host: ids over, rows back)"
    for r in results:
        base = r.median("modulo step")
        print(
            f"\n[{r.stream}] {NUM_TABLES} tables x {rows} rows x {DIM}, batch {BATCH}, "
            f"{where}, {r.warmup} warm-up steps, "
            f"{len(r.times['modulo step'])} measured"
        )
        for key in r.times:
            median = r.median(key)
            print(f"  {key:14s} {median * 1e3:8.2f} ms  {median / base:6.3f}x of the modulo step")
        print(
            f"  per table per step: new ids {r.new_ids:.0f}, evictions {r.evictions:.0f}, "
            f"admissions {r.admissions:.0f}, occupancy {r.occupancy:.3f}"
        )
        _print_syncs(r)
    print(
        "\n| stream | new ids / evictions per table per step | modulo ms | id_map ms | "
        "id_map extra | remap ms | remap / modulo | remap M ids/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        base, mapped, remap = (r.median(k) for k in ("modulo step", "id_map step", "remap native"))
        print(
            f"| {r.stream} | {r.new_ids:.0f} / {r.evictions:.0f} | {base * 1e3:.1f} | "
            f"{mapped * 1e3:.1f} | {(mapped - base) / base:+.0%} | {remap * 1e3:.2f} | "
            f"{remap / base:.0%} | {NUM_TABLES * BATCH / remap / 1e6:.1f} |"
        )


def _print_syncs(r: StreamResult) -> None:
    if r.syncs:
        each = ", ".join(f"{key} {n:.2f}" for key, n in r.syncs.items())
        print(f"  [{r.stream}] host syncs per step: {each}")


def per_id_costs(rows: int, rounds: int) -> dict[str, float]:
    """Seconds per id of the native remap on batches of only known ids and of only new ids
    (full maps: each new id evicts one), and of resetting one fresh row (its 64 floats and
    a per-row state), medians over ``rounds`` interleaved rounds of all 26 maps."""
    tables = bench_tables(rows, IdMapConfig(policy="lru"))
    maps = IdMaps(tables, "cpu")
    by_name = {t.name: maps.table_map(t.name) for t in tables}
    weights = [torch.zeros(rows, DIM) for _ in tables]
    states = [torch.zeros(rows) for _ in tables]
    issued = [0]

    def new_ids() -> dict[str, torch.Tensor]:  # never seen before, scattered
        out = {}
        for t in tables:
            out[t.name] = (torch.arange(issued[0], issued[0] + BATCH) + 1) * 0x5BD1E995
            issued[0] += BATCH
        return out

    for _ in range(rows // BATCH + 2):  # fill every map
        remap_tables(by_name, new_ids(), True)
    times: dict[str, list[float]] = {"known id": [], "new id": [], "fresh row reset": []}
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        known = {
            name: m.row_ids[torch.randperm(rows, generator=gen)[:BATCH]]
            for name, m in by_name.items()
        }
        times["known id"].append(_timed(lambda known=known: remap_tables(by_name, known, True)))
        fresh = new_ids()
        start = time.perf_counter()
        results = remap_tables(by_name, fresh, True)
        times["new id"].append(time.perf_counter() - start)
        resets = [
            cpu_id_map.RowReset(w, r.fresh_rows, r.fresh_ids, r.stats.step, -0.01, 0.01, [s])
            for w, s, r in zip(weights, states, results.values(), strict=True)
        ]
        times["fresh row reset"].append(
            _timed(lambda resets=resets: cpu_id_map.reset_many(resets, torch.get_num_threads()))
        )
    return {k: statistics.median(v) / (NUM_TABLES * BATCH) for k, v in times.items()}


class SummedLoss(nn.Module):
    """A pipeline's model: the pooled embeddings' sum as the loss (the embedding step alone);
    ``ebc``: any collection taking ``batch.sparse`` (fused or sharded)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Batch) -> tuple[torch.Tensor, None]:
        return self.ebc(batch.sparse).values().sum(), None


class _Stream:
    """Batch ``i`` of a stream for both pipelines (raw ids, or ``% rows``), made once, ahead
    (`make`: outside the timed steps)."""

    def __init__(self, name: str, rows: int) -> None:
        self._next = stream_batches(name, rows)
        self._made: dict[bool, list[Batch | None]] = {False: [], True: []}
        self.rows = rows

    def make(self, count: int) -> None:
        """Make the batches up to ``count`` (both variants)."""
        while len(self._made[False]) < count:
            i = len(self._made[False])
            raw = self._next(i)
            for modulo in (False, True):
                ids = raw % self.rows if modulo else raw
                batch = Batch(torch.zeros(BATCH, 1), one_id_bags(ids), torch.zeros(BATCH), i + 1)
                self._made[modulo].append(batch)

    def batches(self, modulo: bool) -> Iterator[Batch]:
        for i in itertools.count():
            self.make(i + 1)  # made already, unless a caller skipped `make`
            batch, self._made[modulo][i] = self._made[modulo][i], None  # freed once taken
            assert batch is not None
            yield batch


def measure_pipelined(
    stream: str,
    rows: int,
    warmup: int,
    steps: int,
    remap_threads: int,
    device: str = "cpu",
    block: int = 10,
) -> StreamResult:
    """The modulo and the `id_map` step, each in its own `TrainPipelineSparseDist` (the
    id_map one remaps batch i+1 on the worker thread during batch i), in alternating blocks of
    ``block`` steps (``steps`` rounded up to whole blocks; the k-th steps of two blocks are
    paired). The `id_map` step's time runs until its worker is idle too: a remap that
    outlasts the step costs the step, and never runs into the modulo step."""
    setup = _Setup(rows, _ID_MAPS[stream], False, device)
    data = _Stream(stream, rows)
    modulo_batches = data.batches(modulo=True)
    pipelines = {
        "modulo step": (
            TrainPipelineSparseDist(SummedLoss(setup.modulo), None, device),
            modulo_batches,
        ),
        "id_map step": (
            TrainPipelineSparseDist(
                SummedLoss(setup.mapped), None, device, remap_threads=remap_threads
            ),
            data.batches(modulo=False),
        ),
    }
    times: dict[str, list[float]] = {key: [] for key in pipelines}
    churn: list[dict[str, float]] = []
    maps = setup.mapped.id_maps
    assert maps is not None

    def mapped_step(pipeline: TrainPipelineSparseDist, batches: Iterator[Batch]) -> None:
        pipeline.progress(batches)
        maps.ahead.settle()  # its worker's overhang counts here, not in the modulo step

    step, measured, worker_s = 0, -warmup, 0.0
    while measured < steps:
        data.make(step + block + 4)  # the pipelines pull up to two batches ahead
        modulo_times = [
            _timed(lambda: pipelines["modulo step"][0].progress(modulo_batches), device)
            for _ in range(block)
        ]
        busy = worker_busy_seconds()
        mapped_times = [
            _timed(lambda: mapped_step(*pipelines["id_map step"]), device) for _ in range(block)
        ]
        busy = worker_busy_seconds() - busy
        step += block
        if measured < 0 and not setup.full() and step < 20 * max(warmup, block):
            continue
        if measured >= 0:
            times["modulo step"].extend(modulo_times)
            times["id_map step"].extend(mapped_times)
            churn.append(_mean_stats(setup))
            worker_s += busy
        measured += block
    mean = {k: statistics.mean(c[k] for c in churn) for k in churn[0]}
    data.make(step + 8)
    syncs = _syncs(
        {
            "modulo step": lambda i: pipelines["modulo step"][0].progress(modulo_batches),
            "id_map step": lambda i: mapped_step(*pipelines["id_map step"]),
        },
        device,
    )
    return StreamResult(
        f"{stream}, pipelined", times, mean["new_ids"], mean["evictions"], mean["admissions"],
        mean["occupancy"], step - steps, syncs, worker_s / len(times["id_map step"]),
    )  # fmt: skip


def report_pipelined(
    results: list[StreamResult], rows: int, remap_threads: int, device: str = "cpu"
) -> None:
    """One markdown table: the pipelined steps and the `id_map` step's extra cost."""
    where = "" if device == "cpu" else f" on {torch.cuda.get_device_name(device)},"
    print(
        f"\npipelined{where}: {NUM_TABLES} tables x {rows} rows x {DIM}, batch {BATCH}, "
        f"{torch.get_num_threads()} torch threads, remap on the worker with {remap_threads}"
    )
    print(
        "| stream | new ids / evictions per table per step | modulo ms | id_map ms | extra | "
        "extra, paired | remap worker ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        base, mapped = r.median("modulo step"), r.median("id_map step")
        pairs = zip(r.times["id_map step"], r.times["modulo step"], strict=True)
        paired = statistics.median(m / b for m, b in pairs) - 1
        print(
            f"| {r.stream} | {r.new_ids:.0f} / {r.evictions:.0f} | {base * 1e3:.1f} | "
            f"{mapped * 1e3:.1f} | {(mapped - base) / base:+.0%} | {paired:+.0%} | "
            f"{(r.worker_s or 0.0) * 1e3:.1f} |"
        )
    print("(remap worker: its busy time per id_map step, mean; beside the step, on its thread)")
    for r in results:
        _print_syncs(r)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", nargs="+", choices=STREAMS, default=list(STREAMS))
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=20, help="steps after the maps are full")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--torch-remap", action="store_true", help="also the torch-ops remap")
    parser.add_argument(
        "--per-id", type=int, default=0, metavar="ROUNDS", help="only the per-id costs"
    )
    parser.add_argument(
        "--pipeline", action="store_true", help="the steps in TrainPipelineSparseDist"
    )
    parser.add_argument("--remap-threads", type=int, default=1, help="with --pipeline")
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="with --pipeline: steps of one pipeline before the other's (1: every step)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda (the tables there; not with --per-id)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device != "cpu" and args.per_id:
        parser.error("--per-id measures the host remap alone: leave --device out")
    if args.pipeline:
        found = [
            measure_pipelined(
                stream,
                args.rows,
                args.warmup,
                args.steps,
                args.remap_threads,
                args.device,
                args.block,
            )  # fmt: skip
            for stream in args.stream
        ]
        report_pipelined(found, args.rows, args.remap_threads, args.device)
        return
    if args.per_id:
        costs = per_id_costs(args.rows, args.per_id)
        print(f"{torch.get_num_threads()} threads, {NUM_TABLES} maps x {args.rows} rows, full:")
        for key, seconds in costs.items():
            print(f"  {key:16s} {seconds * 1e9:7.1f} ns")
        return
    results = [
        measure(stream, args.rows, args.warmup, args.steps, args.torch_remap, args.device)
        for stream in args.stream
    ]
    report(results, args.rows, args.device)


if __name__ == "__main__":
    main()
