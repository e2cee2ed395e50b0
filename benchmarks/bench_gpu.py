"""The GPU benchmark of issue 13, in one run: embedding kernels and the DLRM step on one GPU.

Kernels (configs A, B, C with uniform ids, DLRM with the DLRM script's power-law ids; sgd,
row-wise Adagrad, Adam, row-wise Adam, Adafactor): fbgemm's CUDA TBE called directly (where
fbgemm has the optimizer), recopt's FusedEmbeddingBagCollection (backend auto) and recopt's own
kernel (backend recopt: its Triton kernels; and the same with
Triton switched off, "recopt_torch_ops"), each timed forward + backward (+ fused update) with
CUDA events, and its host syncs per step counted with torch.profiler (cudaStreamSynchronize,
cudaDeviceSynchronize and synchronous cudaMemcpy calls, those inside torch ops such as
``torch.unique`` included; device-to-host copies are counted beside them). DLRM (Criteo shape,
26 x 100k rows, one id per bag): recopt's step against TorchRec's, when TorchRec imports.
Every figure is written (``--out`` and its .md) as soon as it is measured, and each candidate's
memory is freed (``gc.collect``, ``empty_cache``) before the next is built.

    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out gpu.json        # also writes gpu.md
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --quick --out smoke.json
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --uvm-only --out uvm.json  # issue 17 (UVM)

``--uvm`` adds issue 17's UVM target (bench_uvm.py): tables 1.5x the GPU's free memory placed
by the planner (UVM caching, 20%) against the same model scaled down to fit in HBM.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from bench_gpu_report import CANDIDATES, Results, markdown

__all__ = ["CANDIDATES", "Results", "markdown"]  # the report's, kept importable from here

ROOT = pathlib.Path(__file__).resolve().parents[1]
Step = Callable[[int], None]  # runs step ``i`` (batches are cycled)
OPTIMIZERS = ["sgd", "row_wise_adagrad", "adam", "row_wise_adam", "adafactor"]
FBGEMM_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "row_wise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adam": "ADAM",
    "row_wise_adam": "PARTIAL_ROWWISE_ADAM",
}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str
    num_tables: int
    rows: int
    dim: int
    batch: int
    ids_per_bag: int
    ids: str = "uniform"  # or "power_law": the DLRM script's synthetic ids (zipf 1.1)


CONFIGS = {
    "A": Config(name="A", num_tables=8, rows=1_000_000, dim=64, batch=16384, ids_per_bag=20),
    "B": Config(name="B", num_tables=26, rows=100_000, dim=128, batch=16384, ids_per_bag=20),
    "C": Config(name="C", num_tables=26, rows=1_000_000, dim=128, batch=65536, ids_per_bag=1),
    # The DLRM script's Criteo shape and power-law ids: the hottest id of a feature comes
    # ~1,600 times a batch, what configs A, B, C (uniform ids) never show.
    "DLRM": Config(
        name="DLRM", num_tables=26, rows=100_000, dim=128, batch=16384, ids_per_bag=1,
        ids="power_law",
    ),
}  # fmt: skip
QUICK = {
    k: Config(name=k, num_tables=c.num_tables, rows=c.rows // 100, dim=c.dim, batch=512,
              ids_per_bag=c.ids_per_bag, ids=c.ids)
    for k, c in CONFIGS.items()
}  # fmt: skip


# ---------------------------------------------------------------------------- kernels


def make_batches(cfg: Config, count: int, device: torch.device) -> list[torch.Tensor]:
    """Ids of ``count`` batches, feature-major (one bag length for every bag): uniform, or
    for ``power_law`` those of the DLRM script's synthetic data (recopt.data.synthetic)."""
    if cfg.ids == "power_law":
        from recopt.data import SyntheticClickLog, SyntheticConfig

        if cfg.ids_per_bag != 1:
            raise ValueError(f"config {cfg.name}: power-law ids come one per bag, as in DLRM")
        features = [(f"f{i}", cfg.rows) for i in range(cfg.num_tables)]
        log = SyntheticClickLog(features, SyntheticConfig(), batch_size=cfg.batch)
        return [log.generate(k)[1].values().to(device) for k in range(count)]
    gen = torch.Generator().manual_seed(0)
    n = cfg.num_tables * cfg.batch * cfg.ids_per_bag
    return [torch.randint(0, cfg.rows, (n,), generator=gen).to(device) for _ in range(count)]


def fbgemm_direct(cfg: Config, optimizer: str, ids: list[torch.Tensor]) -> Step:
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

    spec = (cfg.rows, cfg.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [spec] * cfg.num_tables,
        optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer]),
        learning_rate=0.01,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
    ).cuda()
    offsets = _offsets(cfg, ids[0].device)
    grad = torch.ones(cfg.batch, cfg.num_tables * cfg.dim, device=ids[0].device)

    def step(i: int) -> None:
        tbe(ids[i % len(ids)], offsets).backward(grad)

    return step


def fused_collection(
    cfg: Config, optimizer: str, ids: list[torch.Tensor], backend: str, triton: bool = True
) -> Step:
    """recopt's collection; ``triton=False`` runs recopt's kernel on torch ops only."""
    from recopt.kernels import updates
    from recopt.kernels.config import Backend, FusedOptimizerConfig
    from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from recopt.sparse import KeyedJaggedTensor

    device = ids[0].device
    keys = [f"f{i}" for i in range(cfg.num_tables)]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=cfg.rows, embedding_dim=cfg.dim, feature_names=[keys[i]]
        )
        for i in range(cfg.num_tables)
    ]
    config = FusedOptimizerConfig(name=optimizer, lr=0.01, backend=Backend(backend))
    module = FusedEmbeddingBagCollection(tables, optimizer=config, device=device)
    lengths = torch.full(
        (cfg.num_tables * cfg.batch,), cfg.ids_per_bag, dtype=torch.int64, device=device
    )
    kjts = [KeyedJaggedTensor(keys, batch, lengths=lengths, stride=cfg.batch) for batch in ids]
    grad = torch.ones(cfg.batch, cfg.num_tables * cfg.dim, device=device)

    def step(i: int) -> None:
        module(kjts[i % len(kjts)]).values().backward(grad)

    def step_torch_ops(i: int) -> None:
        chosen = updates.adafactor_rows_impl, updates.triton_sparse_update
        updates.adafactor_rows_impl = lambda weight: updates.adafactor_rows_torch
        updates.triton_sparse_update = lambda: None
        try:
            step(i)
        finally:
            updates.adafactor_rows_impl, updates.triton_sparse_update = chosen

    return step if triton else step_torch_ops


def _offsets(cfg: Config, device: torch.device) -> torch.Tensor:
    n = cfg.num_tables * cfg.batch * cfg.ids_per_bag
    return torch.arange(0, n + 1, cfg.ids_per_bag, dtype=torch.int64, device=device)


def time_ms(step: Step, warmup: int, steps: int) -> float:
    """Median milliseconds of one step, CUDA events around each."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(warmup + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_syncs(step: Step, steps: int) -> dict[str, float]:
    """Host syncs and device-to-host copies per step, from torch.profiler's CUDA runtime events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()  # the profiler's own, subtracted below
    counts = dict.fromkeys(SYNC_CALLS, 0)
    dtoh = 0
    for event in prof.events():
        if event.name in counts:
            counts[event.name] += 1
        if "DtoH" in event.name or "Device -> Pageable" in event.name:
            dtoh += 1
    counts["cudaDeviceSynchronize"] = max(0, counts["cudaDeviceSynchronize"] - 1)
    per_step = {name: n / steps for name, n in counts.items()}
    per_step["syncs"] = sum(per_step.values())
    per_step["dtoh_copies"] = dtoh / steps
    return per_step


def release() -> None:
    """Frees what the last candidate left (a reference cycle keeps a module alive until
    ``gc.collect``; freed blocks stay in torch's cache until ``empty_cache``)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_kernels(
    cfg: Config, warmup: int, steps: int, results: Results, device: torch.device | None = None
) -> None:
    """Times every candidate of every optimizer on ``cfg``; each row is saved when measured."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    ids = make_batches(cfg, 4, device)
    for optimizer in OPTIMIZERS:
        candidates: dict[str, Callable[[], Step]] = {}
        if optimizer in FBGEMM_OPTIMIZERS:
            candidates["fbgemm_direct"] = lambda o=optimizer: fbgemm_direct(cfg, o, ids)
        candidates["fused_auto"] = lambda o=optimizer: fused_collection(cfg, o, ids, "auto")
        candidates["recopt_kernel"] = lambda o=optimizer: fused_collection(cfg, o, ids, "recopt")
        candidates["recopt_torch_ops"] = lambda o=optimizer: fused_collection(
            cfg, o, ids, "recopt", triton=False
        )  # recopt's Triton kernels against its torch ops
        for name, build in candidates.items():
            row: dict[str, Any] = {"config": cfg.name, "optimizer": optimizer, "candidate": name}
            try:
                step = build()
                row["ms"] = round(time_ms(step, warmup, steps), 3)
                row.update({k: round(v, 2) for k, v in host_syncs(step, 3).items()})
            except Exception as err:  # one candidate failing must not lose the others' figures
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            finally:
                step = None  # type: ignore[assignment]
                release()
            results.add_kernel(row)
            print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------- DLRM


def recopt_dlrm_step(dim: int, batch_size: int, device: torch.device) -> Step:
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    from dlrm_config import load_config
    from train import RunEnv, build_data, build_model, build_optimizer

    overrides = [f"data.batch_size={batch_size}", f"model.bottom_mlp=[512, 256, {dim}]"]
    overrides += [f"embedding.tables.{i}.embedding_dim={dim}" for i in range(26)]
    config = load_config(str(ROOT / "configs" / "dlrm_criteo_shape.toml"), overrides)
    env = RunEnv(device=device)
    model = build_model(config, device)
    optimizer = build_optimizer(model, config)
    data = build_data(config, env, "train")
    batches = [next(data).to(device) for _ in range(4)]  # made ahead, as for TorchRec

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def torchrec_dlrm_step(dim: int, batch_size: int, device: torch.device) -> Step:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    rows, features = 100_000, 26
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"cat_{i}"]
        )
        for i in range(features)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[512, 256, dim],
        over_arch_layer_sizes=[512, 256, 1],
        dense_device=device,
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(model, device=device)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.02),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        u = torch.rand(features * batch_size, generator=gen, dtype=torch.float64)
        ids = (torch.pow(rows + 1.0, u).floor().long() - 1).clamp(0, rows - 1)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"cat_{i}" for i in range(features)],
            values=ids,
            lengths=torch.ones(features * batch_size, dtype=torch.int64),
        ).to(device)
        dense_x = torch.rand(batch_size, 13, generator=gen).to(device)
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float().to(device)
        batches.append((dense_x, kjt, labels))

    def step(i: int) -> None:
        dense_x, kjt, labels = batches[i % len(batches)]
        logits = dmp(dense_x, kjt).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def run_dlrm(
    dims: list[int], batches: list[int], warmup: int, steps: int, results: Results
) -> None:
    torchrec_error = None
    try:
        import torchrec  # noqa: F401
    except Exception as err:  # absent, or built against another torch: recopt's side still runs
        torchrec_error = f"{type(err).__name__}: {err}"[:300]
    for dim in dims:
        for batch_size in batches:
            row: dict[str, Any] = {"dim": dim, "batch": batch_size}
            for name, build in (("recopt", recopt_dlrm_step), ("torchrec", torchrec_dlrm_step)):
                if name == "torchrec" and torchrec_error is not None:
                    row["torchrec_ms"] = None
                    row["torchrec_error"] = torchrec_error
                    continue
                try:
                    step = build(dim, batch_size, torch.device("cuda", torch.cuda.current_device()))
                    row[f"{name}_ms"] = round(time_ms(step, warmup, steps), 3)
                    row[f"{name}_syncs"] = round(host_syncs(step, 3)["syncs"], 2)
                except Exception as err:  # keep the other side's figure
                    row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
                step = None  # type: ignore[assignment]
                release()
            if row.get("recopt_ms") and row.get("torchrec_ms"):
                row["recopt_over_torchrec_speed"] = round(row["torchrec_ms"] / row["recopt_ms"], 3)
            results.add_dlrm(row)
            print(json.dumps(row), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON results (a .md table is written beside)")
    parser.add_argument(
        "--configs",
        default="A,B,C,DLRM",
        help="comma-separated subset of A,B,C,DLRM (DLRM: the DLRM script's power-law ids)",
    )
    parser.add_argument("--quick", action="store_true", help="tables / 100, batch 512: a smoke run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--dlrm-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--dlrm-batches", type=int, nargs="*", default=[2048, 16384])
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--uvm", action="store_true", help="also run issue 17's UVM target")
    parser.add_argument("--uvm-only", action="store_true", help="run only the UVM target")
    parser.add_argument(
        "--uvm-hbm-gib",
        type=float,
        help="HBM budget of the UVM run (default: the free memory; the large set needs 1.5x "
        "it in host memory, so lower it on a host with less RAM than that)",
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write(
            "bench_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run it on a GPU "
            "host with fbgemm-gpu's CUDA build (see ../shared/gpu/README.md).\n"
        )
        return 2
    os.environ.setdefault("LOCAL_RANK", "0")  # TorchRec's DMP reads it
    torch.cuda.set_device(0)
    device_name = torch.cuda.get_device_name(0)
    configs = QUICK if args.quick else CONFIGS
    names = args.configs.split(",")
    meta: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "quick": args.quick}
    meta["configs"] = {k: asdict(configs[k]) for k in names}
    results = Results(pathlib.Path(args.out), meta)
    results.save()  # an empty table at once: the file exists even if the first row never comes
    if args.uvm or args.uvm_only:
        from bench_uvm import UvmConfig, run_uvm

        cfg = UvmConfig(batch=512) if args.quick else UvmConfig()
        hbm_gib = args.uvm_hbm_gib or (1.0 if args.quick else None)  # quick: a 1 GiB budget
        results.set_uvm(run_uvm(time_ms, args.warmup, args.steps, hbm_gib, cfg))
        print(json.dumps(results.uvm), flush=True)
        release()
    if args.uvm_only:
        print(results.save())
        return 0
    if not args.skip_kernels:
        for name in names:
            run_kernels(configs[name], args.warmup, args.steps, results)
    if args.dlrm_dims:
        _dlrm_in_a_group(args, results)
    print(results.save())
    return 0


def _dlrm_in_a_group(args: argparse.Namespace, results: Results) -> None:
    from recopt import comm

    with tempfile.TemporaryDirectory() as tmp:  # TorchRec's DMP needs a process group
        comm.init_process_group(
            torch.device("cuda", 0),
            init_method=f"file://{tmp}/rendezvous",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=300),
        )
        try:
            batches = [512] if args.quick else args.dlrm_batches
            run_dlrm(args.dlrm_dims, batches, args.warmup, args.steps, results)
        finally:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
