"""Baseline for bench_dlrm.py: the same Criteo-shaped DLRM step in TorchRec, same phases.

Run with an interpreter that has TorchRec (it is not a recopt dependency), e.g.

    /tmp/trvenv/bin/python benchmarks/bench_dlrm_torchrec.py --dims 64 128 --threads 1

TorchRec's own DLRM model, its single-rank DistributedModelParallel (fused row-wise Adagrad
applied in backward, lr 0.05) and torch Adagrad for the dense part, as TorchRec's examples
train it. Batches (26 features, one id per bag, power-law ids) are made before timing, so the
numbers are forward + backward + optimizer only; bench_dlrm.py reports its data phase apart.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

NUM_FEATURES = 26
ROWS = 100_000


def make_batches(batch_size: int, count: int) -> list[tuple[torch.Tensor, object, torch.Tensor]]:
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        u = torch.rand(NUM_FEATURES * batch_size, generator=gen, dtype=torch.float64)
        ids = (torch.pow(ROWS + 1.0, u).floor().long() - 1).clamp(0, ROWS - 1)  # log-uniform
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"cat_{i}" for i in range(NUM_FEATURES)],
            values=ids,
            lengths=torch.ones(NUM_FEATURES * batch_size, dtype=torch.int64),
        )
        dense = torch.rand(batch_size, 13, generator=gen)
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
        batches.append((dense, kjt, labels))
    return batches


def build(dim: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=ROWS, feature_names=[f"cat_{i}"]
        )
        for i in range(NUM_FEATURES)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[512, 256, dim],
        over_arch_layer_sizes=[512, 256, 1],
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.02),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def measure(dim: int, batch_size: int, steps: int, warmup: int) -> str:
    model, optimizer = build(dim)
    batches = make_batches(batch_size, warmup + steps)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    wall = cpu = 0.0
    for step, (dense, kjt, labels) in enumerate(batches):
        marks = [(time.perf_counter(), time.process_time())]
        logits = model(dense, kjt).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        marks.append((time.perf_counter(), time.process_time()))
        optimizer.zero_grad()
        loss.backward()
        marks.append((time.perf_counter(), time.process_time()))
        optimizer.step()
        marks.append((time.perf_counter(), time.process_time()))
        if step >= warmup:
            for i, phase in enumerate(phases):
                phases[phase].append(marks[i + 1][1] - marks[i][1])
            wall += marks[-1][0] - marks[0][0]
            cpu += marks[-1][1] - marks[0][1]
    cpu_ms = " ".join(f"{p} {statistics.mean(v) * 1e3:.1f}" for p, v in phases.items())
    return (
        f"torchrec dim {dim} threads {torch.get_num_threads()}: "
        f"{batch_size * steps / wall / 1e3:.1f}k samples/s wall, "
        f"{batch_size * steps / cpu / 1e3:.1f}k per CPU-s | CPU ms: {cpu_ms}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            for threads in args.threads:
                torch.set_num_threads(threads)
                for dim in args.dims:
                    print(measure(dim, args.batch_size, args.steps, args.warmup), flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
