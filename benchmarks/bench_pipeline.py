"""Pipelined vs plain training step: 2 gloo ranks on CPU, per sharding type and a mixed plan.

Each rank trains a sharded 26-table stage under a small dense top (forward, backward with the
fused update, dense SGD step), once with the plain loop and once with TrainPipelineSparseDist,
interleaved in the same spawned group (best of ``--rounds``). Reported per plan: the plain
step, its input distribution (count exchange + id all-to-all, waited for in the forward), the
pipelined step and its phases: ``start`` (batch i+1's routing and count exchange, still on the
step's path) and ``wait`` (what is left of the id all-to-all when batch i's forward needs it).
Run: ``python benchmarks/bench_pipeline.py [--threads 1] [--batch 2048] [--dim 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch import nn

from recopt.data.batch import Batch
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding.plan import ShardingType
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

KINDS = [*(kind.value for kind in ShardingType), "mixed"]


class _Stage(nn.Module):
    """Sharded embeddings, then a dense top: ``batch -> (loss, loss)``."""

    def __init__(self, embedding: nn.Module, width: int, hidden: int) -> None:
        super().__init__()
        self.embedding_bags = embedding
        layers = [nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1)] if hidden else []
        self.top = nn.Sequential(*layers) if hidden else nn.Linear(width, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.embedding_bags(batch.sparse).values()
        logits = self.top(pooled).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, loss.detach()


def _requests(kind: str, names: list[str], world: int) -> dict[str, Any]:
    from recopt.sharding import (
        column_wise,
        data_parallel,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )

    makers: dict[str, Any] = {
        "table_wise": lambda i: table_wise(i % world),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(list(range(world))),
        "table_row_wise": lambda i: table_row_wise(0),
        "table_column_wise": lambda i: table_column_wise(0),
        "data_parallel": lambda i: data_parallel(),
    }
    if kind == "mixed":
        order = ["table_wise", "row_wise", "column_wise", "data_parallel"]
        return {n: makers[order[i % 4]](i) for i, n in enumerate(names)}
    return {n: makers[kind](i) for i, n in enumerate(names)}


def _batches(args: argparse.Namespace, rank: int, count: int) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + rank)
    keys = [f"f{i}" for i in range(args.tables)]
    out = []
    for i in range(count):
        lengths = torch.full((args.tables * args.batch,), args.ids, dtype=torch.int64)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        labels = torch.randint(0, 2, (args.batch,), generator=g).float()
        sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        out.append(Batch(torch.zeros(args.batch, 1), sparse, labels, i + 1))
    return out


def _build(args: argparse.Namespace, kind: str, world: int) -> tuple[Any, Any, Any]:
    from recopt.sharding import ShardedEmbeddingBagCollection, construct_module_sharding_plan

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=[f"f{i}"]
        )
        for i in range(args.tables)
    ]
    requests = _requests(kind, [t.name for t in tables], world)
    shardings = construct_module_sharding_plan(tables, requests, world)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.01)
    ebc = ShardedEmbeddingBagCollection(tables, shardings, optimizer=optimizer)
    model = _Stage(ebc, args.tables * args.dim, args.hidden)
    return model, ebc, torch.optim.SGD(model.top.parameters(), lr=0.01)


def _plain(args: argparse.Namespace, kind: str, rank: int, world: int) -> dict[str, float]:
    model, ebc, optimizer = _build(args, kind, world)
    batches = _batches(args, rank, args.warmup + args.steps)
    for i, batch in enumerate(batches):
        if i == args.warmup:
            ebc.phase_seconds = {}
            start = time.perf_counter()
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
    step = (time.perf_counter() - start) / args.steps
    return {
        "step_ms": 1000 * step,
        "input_dist_ms": 1000 * ebc.phase_seconds["input_dist"] / args.steps,
    }


def _pipelined(args: argparse.Namespace, kind: str, rank: int, world: int) -> dict[str, float]:
    from recopt.sharding import TrainPipelineSparseDist

    model, ebc, optimizer = _build(args, kind, world)
    data = iter(_batches(args, rank, args.warmup + args.steps))
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    for _ in range(args.warmup):
        pipeline.progress(data)
    pipeline.reset_phase_seconds()
    ebc.phase_seconds = {}
    start = time.perf_counter()
    for _ in range(args.steps):
        pipeline.progress(data)
    step = (time.perf_counter() - start) / args.steps
    phases = pipeline.phase_seconds
    return {
        "step_ms": 1000 * step,
        "start_ms": 1000 * phases["input_dist"] / args.steps,
        "wait_ms": 1000 * ebc.phase_seconds["input_dist"] / args.steps,
        **{f"{k}_ms": 1000 * phases[k] / args.steps for k in ("forward", "backward", "optimizer")},
    }


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for _ in range(args.rounds):  # interleaved: both loops see the same machine noise
        for kind in args.types.split(","):
            for name, run in (("plain", _plain), ("pipelined", _pipelined)):
                row = run(args, kind, rank, world)
                best = results.setdefault(kind, {}).get(name)
                if best is None or row["step_ms"] < best["step_ms"]:
                    results[kind][name] = row
    return results


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The slower rank's figures per plan, and the target check."""
    out: dict[str, Any] = {}
    for kind in per_rank[0]:
        rows = {
            name: {k: max(r[kind][name][k] for r in per_rank) for k in per_rank[0][kind][name]}
            for name in ("plain", "pipelined")
        }
        plain, piped = rows["plain"], rows["pipelined"]
        share = plain["input_dist_ms"] / plain["step_ms"]
        bound = plain["step_ms"] - 0.7 * plain["input_dist_ms"]
        out[kind] = {
            **rows,
            "input_dist_share": round(share, 3),
            "target_ms": round(bound, 2),
            "meets_target": piped["step_ms"] <= bound if share >= 0.15 else None,
            "speedup": round(plain["step_ms"] / piped["step_ms"], 3),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="per rank")
    parser.add_argument("--ids", type=int, default=1, help="ids per bag")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=0, help="dense top's hidden width")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--types", default=",".join(KINDS))
    parser.add_argument("--rounds", type=int, default=2, help="best of, interleaved")
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(_rank, 2, args, timeout_s=1800)
    config = {k: v for k, v in vars(args).items()}
    config["loadavg_1_5_15_min_at_end"] = os.getloadavg()
    print(json.dumps({"config": config, "results": _summary(per_rank)}, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
