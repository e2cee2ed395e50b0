"""A replica group training fused embedding tables + a dense layer under fault tolerance.

Run as ``python tests/ft_fused_worker.py --replica-id A --lighthouse-port P --out DIR``. The
recopt kernel's ``grad_hook`` (docs/design.md) carries the cross-replica row averaging. Every
batch looks up every table, because the kernel calls the hook only for tables with ids.
Writes the same files as ft_worker.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
from torch import nn

from recopt.ft.launch import make_fault_tolerant
from recopt.ft.manager import ManagerConfig
from recopt.kernels.config import Backend
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, FusedOptimizerConfig
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sparse import KeyedJaggedTensor


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", num_embeddings=25, embedding_dim=8, feature_names=["f1"]),
        ]
        # Two kernels: Adam (per-row 2-D state) on t0, row-wise Adagrad (1-D state) on t1.
        config = FusedOptimizerConfig(name="adam", lr=0.05, backend=Backend.RECOPT)
        rowwise = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, backend=Backend.RECOPT)
        self.sparse = FusedEmbeddingBagCollection(
            tables, optimizer=config, table_optimizers={"t1": rowwise}
        )
        self.dense = nn.Linear(16, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out: torch.Tensor = self.dense(self.sparse(features).values())
        return out


def batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    ids = {
        name: [
            torch.randint(0, rows, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 4, (4,), generator=g)
        ]
        for name, rows in (("f0", 40), ("f1", 25))
    }
    return KeyedJaggedTensor.from_id_lists(ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--rank-seed", type=int, default=0)
    parser.add_argument("--lighthouse-port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--wait-live", type=int, default=2)
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--nan-at", type=int, default=-1, help="iteration whose loss is NaN")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.rank_seed)
    model = Model()
    dense = KeyedOptimizerWrapper(
        dict(model.dense.named_parameters()), lambda p: torch.optim.AdamW(p, lr=0.01)
    )
    optimizer = CombinedOptimizer([("sparse", model.sparse.fused_optimizer), ("dense", dense)])
    timeout = datetime.timedelta(seconds=10)
    config = ManagerConfig(
        replica_id=args.replica_id,
        lighthouse=("127.0.0.1", args.lighthouse_port),
        timeout=timeout,
        quorum_timeout=timeout * 3,
        hostname="127.0.0.1",
    )
    ft = make_fault_tolerant(
        model, optimizer, config, wait_for=args.wait_live, sync_embeddings=not args.no_sync
    )
    step_dir = os.path.join(args.out, args.replica_id)
    os.makedirs(step_dir, exist_ok=True)
    log = open(os.path.join(args.out, f"{args.replica_id}.jsonl"), "a", buffering=1)
    iteration = 0
    while ft.manager.current_step() < args.steps:
        ft.optimizer.zero_grad()  # before forward: the quorum may heal the model
        start = ft.manager.current_step()
        seed = 1000 * start + ft.manager.participant_rank()
        scale = float("nan") if iteration == args.nan_at else 1.0
        (model(batch(seed)).pow(2).mean() * scale).backward()
        ft.optimizer.step()
        committed = ft.manager.current_step() > start
        entry = {"step": start, "iteration": iteration, "committed": committed}
        log.write(json.dumps({**entry, "time": time.time()}) + "\n")
        iteration += 1
        if committed:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            torch.save(state, os.path.join(step_dir, f"step{ft.manager.current_step()}.pt"))
    ft.shutdown()


if __name__ == "__main__":
    main()
