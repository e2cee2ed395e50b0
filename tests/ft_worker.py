"""A replica group for the fault-tolerance tests: trains a small MLP under a Manager.

Run as ``python tests/ft_worker.py --replica-id A --lighthouse-port P --out DIR ...``. Each
attempted step appends one JSON line to ``DIR/<id>.jsonl`` (step before and after, commit,
participants, error, a digest of parameters + optimizer state before and after); each
committed step's full state goes to ``DIR/<id>/step<k>.pt``. Fault injection: ``--pause-at
STEP --pause-s S`` sleeps inside the gradient all-reduce after writing ``DIR/<id>.paused``
(the test SIGKILLs it there, or lets it hang past the collective timeout).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from recopt.ft import Manager, ManagerConfig, OptimizerWrapper
from recopt.ft.client import wait_for_replicas


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """Hash of every parameter and optimizer-state tensor, bit for bit."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    for pid, state in sorted(optim.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{pid}.{key}".encode())
            h.update(torch.as_tensor(value).contiguous().numpy().tobytes())
    return h.hexdigest()


class FaultyManager(Manager):
    """Pauses inside the gradient all-reduce of one step, after announcing it in a file."""

    def __init__(self, *args: Any, pause_at: int, pause_s: float, marker: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pause_at, self.pause_s, self.marker = pause_at, pause_s, marker

    def allreduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        if self.current_step() == self.pause_at and self.pause_s > 0:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(self.pause_s)
            self.pause_s = 0.0  # only once
        super().allreduce_gradients(params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--rank-seed", type=int, default=0)
    parser.add_argument("--lighthouse-port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--min-replica-size", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--max-attempts", type=int, default=5000)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--wait-live", type=int, default=1)
    parser.add_argument("--group-rank", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Replicas start different (init_sync must fix it); ranks of a group stand for shards.
    torch.manual_seed(args.rank_seed * 100 + args.group_rank)
    name = args.replica_id if args.group_size == 1 else f"{args.replica_id}-r{args.group_rank}"
    model = nn.Sequential(nn.Linear(8, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = datetime.timedelta(seconds=args.timeout_s)
    config = ManagerConfig(
        replica_id=args.replica_id,
        lighthouse=("127.0.0.1", args.lighthouse_port),
        min_replica_size=args.min_replica_size,
        timeout=timeout,
        quorum_timeout=timeout * 2,
        hostname="127.0.0.1",
        group_rank=args.group_rank,
        group_world_size=args.group_size,
    )
    marker = os.path.join(args.out, f"{name}.paused")
    manager = FaultyManager(
        config,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        pause_at=args.pause_at,
        pause_s=args.pause_s,
        marker=marker,
    )
    optim = OptimizerWrapper(manager, inner)
    wait_for_replicas(config.lighthouse, args.wait_live, datetime.timedelta(seconds=60))
    step_dir = os.path.join(args.out, name)
    os.makedirs(step_dir, exist_ok=True)
    log = open(os.path.join(args.out, f"{name}.jsonl"), "a", buffering=1)
    stop = os.path.join(args.out, "stop")
    for attempt in range(args.max_attempts):
        if os.path.exists(stop):
            break
        time.sleep(args.step_sleep)  # pace the run so that a restarted peer can catch up
        step_before = manager.current_step()
        start = time.monotonic()
        optim.zero_grad()
        healed_to = manager.current_step()
        before = digest(model, inner)
        # Data depends only on (step, rank in quorum), so replicas agree on what a step means.
        g = torch.Generator().manual_seed(
            1000 * manager.current_step() + 10 * manager.participant_rank() + args.group_rank
        )
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        optim.step()
        committed = manager.current_step() > healed_to
        entry = {
            "attempt": attempt,
            "step_before": step_before,
            "healed_to": healed_to,
            "step_after": manager.current_step(),
            "committed": committed,
            "participants": manager.num_participants(),
            "error": None if manager.errored() is None else repr(manager.errored()),
            "digest_before": before,
            "digest_after": digest(model, inner),
            "seconds": time.monotonic() - start,
            "time": time.time(),
        }
        log.write(json.dumps(entry) + "\n")
        if committed:
            path = os.path.join(step_dir, f"step{manager.current_step()}.pt")
            torch.save(state_dict(), path)
    manager.shutdown()


if __name__ == "__main__":
    main()
