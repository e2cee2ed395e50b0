"""One rank of a sharded replica group for the fault-tolerance tests (DLRM under DMP).

Run as ``python tests/ft_sharded_worker.py --replica-id A --group-rank R --lighthouse-port P
--out DIR ...``: the group's ranks meet on ``file://DIR/<id>.pg``, shard a small DLRM's tables
(row-wise, table-wise, data-parallel; recopt kernels, fused Adam) with
`DistributedModelParallel`, and train under `make_fault_tolerant` until ``--steps`` commits.
Each attempt appends to ``DIR/<id>-r<R>.jsonl``: the step, whether it committed, and digests
of the rank's local state after the quorum (healing), after backward (the fused update) and
after the vote. ``--drop-at S`` marks step S errored after backward (every rank of every
group does it, so the step is dropped everywhere); ``--wait-peers-at S`` waits at step S
until two replica groups are live, so that a late group joins (and heals) there;
``--step-sleep`` paces the steps (so that a test can kill a rank between them);
``--hold-file F`` builds everything, then waits for F before joining the replica groups.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from recopt.ft.client import wait_for_replicas
from recopt.ft.launch import FaultTolerantTraining, make_fault_tolerant, state_digest
from recopt.ft.manager import ManagerConfig
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.models.dlrm import DLRM, DLRMConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sharding import ShardingPlan, construct_module_sharding_plan
from recopt.sharding.model_parallel import DistributedModelParallel
from recopt.sharding.plan_helpers import data_parallel, row_wise, table_wise
from recopt.sparse import KeyedJaggedTensor

ROWS = {"t0": 40, "t1": 30, "t2": 12}


def build(seed: int, timeout: datetime.timedelta) -> tuple[nn.Module, CombinedOptimizer]:
    torch.manual_seed(seed)  # the same on the group's ranks, different between groups
    tables = [
        EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=8, feature_names=(f"f{t}",))
        for t, n in ROWS.items()
    ]
    optimizer = FusedOptimizerConfig(name="adam", lr=0.05, backend=Backend.RECOPT)
    sparse = FusedEmbeddingBagCollection(tables, optimizer=optimizer)
    model = DLRM(sparse, DLRMConfig(dense_in_features=4, bottom_mlp=(8, 8), top_mlp=(8,)))
    requests = {"t0": row_wise(), "t1": table_wise(1), "t2": data_parallel()}
    path = next(n for n, m in model.named_modules() if m is sparse)
    plan = ShardingPlan(
        {path: construct_module_sharding_plan(tables, requests, 2, module_path=path)}
    )
    dmp = DistributedModelParallel(model, plan=plan, timeout=timeout)
    dense = KeyedOptimizerWrapper(
        dict(dmp.named_parameters()), lambda p: torch.optim.Adam(p, lr=0.01)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, ("dense", dense)])


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed * 10_000 + step * 10 + rank)
    ids = {
        f"f{t}": [torch.randint(0, n, (int(torch.randint(0, 3, (1,), generator=g)),),
                                generator=g).tolist() for _ in range(6)]
        for t, n in ROWS.items()
    }  # fmt: skip
    return torch.randn(6, 4, generator=g), KeyedJaggedTensor.from_id_lists(ids)


def run(
    ft: FaultTolerantTraining,
    model: nn.Module,
    optimizer: CombinedOptimizer,
    args: argparse.Namespace,
) -> None:
    """Train until ``args.steps`` commits, one JSON line per attempt."""
    manager = ft.manager
    rank = args.group_rank

    def digest() -> str:
        return state_digest(model.state_dict(), optimizer.state_dict())

    log = open(os.path.join(args.out, f"{args.replica_id}-r{rank}.jsonl"), "a", buffering=1)
    dropped = False
    for attempt in range(100):
        if manager.current_step() >= args.steps:
            break
        if manager.current_step() == args.wait_peers_at:
            wait_for_replicas(manager.config.lighthouse, 2, manager.config.timeout * 3)
        time.sleep(args.step_sleep)
        ft.optimizer.zero_grad()
        step = manager.current_step()
        after_quorum = digest()
        dense, sparse = batch(args.seed, step, rank)
        logits = model(dense, sparse)
        nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(6)).backward()
        if step == args.drop_at and not dropped:
            manager.report_error(RuntimeError("injected by the test"))
            dropped = True
        after_backward = digest()
        ft.optimizer.step()
        entry = {
            "attempt": attempt,
            "step": step,
            "committed": manager.current_step() > step,
            "participants": manager.num_participants(),
            "error": None if manager.errored() is None else repr(manager.errored()),
            "after_quorum": after_quorum,
            "after_backward": after_backward,
            "after_vote": digest(),
            "time": time.time(),
        }
        log.write(json.dumps(entry) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--group-rank", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lighthouse-port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--drop-at", type=int, default=-1)
    parser.add_argument("--wait-peers-at", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--hold-file", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=20)
    rank = args.group_rank
    init = f"file://{os.path.join(args.out, args.replica_id)}.pg"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
    model, optimizer = build(args.seed, timeout)
    config = ManagerConfig(
        replica_id=args.replica_id,
        lighthouse=("127.0.0.1", args.lighthouse_port),
        timeout=timeout,
        quorum_timeout=timeout * 2,
        hostname="127.0.0.1",
        group_rank=rank,
        group_world_size=2,
    )
    deadline = time.monotonic() + 120
    while args.hold_file and not os.path.exists(args.hold_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{args.hold_file} did not appear within 120 s")
        time.sleep(0.05)
    ft = make_fault_tolerant(model, optimizer, config)

    run(ft, model, optimizer, args)
    ft.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
