"""Fault-tolerance benchmarks on torchft: per-step overhead vs DDP, recovery after a death, heal.

Run: ``.venv/bin/python benchmarks/bench_ft.py [--quick]`` (needs the ``ft`` extra). Replica
groups are spawned processes on this machine (gloo over loopback), each a `TorchftManager`
with its own TCPStore (torchrun's role); torchft's lighthouse runs in this process. Prints one
JSON line per measurement. The comparison with recopt's own engine (``--engines``) was measured
before that engine was retired; benchmarks/README.md keeps its figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from recopt.ft import OptimizerWrapper
from recopt.ft.torchft_manager import TorchftConfig, TorchftManager
from recopt.testing import run_on_ranks

TIMEOUT = datetime.timedelta(seconds=30)


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _params(width: int, depth: int) -> int:
    return depth * (width * width + width) + width + 1


def _lighthouse(min_replicas: int, heartbeat_ms: int = 1000) -> tuple[Any, str]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=1000,
        heartbeat_timeout_ms=heartbeat_ms,
    )
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def _ddp_rank(rank: int, world_size: int, width: int, depth: int, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_model(width, depth))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optim.zero_grad()
        model(torch.randn(32, width)).pow(2).mean().backward()
        optim.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return times[2:]


class _Replica:
    """One replica group's process: an MLP, AdamW, and a `TorchftManager` on ``address``."""

    def __init__(self, replica_id: str, address: str, width: int, depth: int) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = _model(width, depth)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.width = width
        # The group's store (torchrun's role), alive as long as the manager.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        config = TorchftConfig(
            replica_id=replica_id,
            lighthouse_addr=address,
            store_addr="127.0.0.1",
            store_port=self.store.port,
            timeout=TIMEOUT,
            quorum_timeout=TIMEOUT,
        )
        self.manager = TorchftManager(config, state_dict=self.state_dict, load_state_dict=self.load)
        self.optim = OptimizerWrapper(self.manager, self.inner)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.inner.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["optim"])

    def forward_backward(self, batch: int = 32) -> None:
        self.model(torch.randn(batch, self.width)).pow(2).mean().backward()


def _ft_replica(
    replica_id: str,
    address: str,
    width: int,
    depth: int,
    steps: int,
    kill_at: int,
    results: Any,
    ready: Any,
) -> None:
    replica = _Replica(replica_id, address, width, depth)
    ready.wait(timeout=120)  # both groups built: the first quorum has them both
    report: dict[str, Any] = {"replica": replica_id, "steps": [], "commits": []}
    for attempt in range(steps):
        start = time.perf_counter()
        replica.optim.zero_grad()
        quorum_s = time.perf_counter() - start
        replica.forward_backward()
        if attempt == kill_at:
            results.put({"replica": replica_id, "killed_at": time.time()})
            results.close()
            results.join_thread()  # flushed before the kill, or the message is lost
            os.kill(os.getpid(), signal.SIGKILL)  # the peer is now inside the all-reduce
        before = replica.manager.current_step()
        replica.optim.step()
        n = replica.manager.num_participants()
        report["steps"].append(
            {"seconds": time.perf_counter() - start, "quorum_s": quorum_s, "n": n}
        )
        if replica.manager.current_step() > before:
            report["commits"].append(time.time())
    results.put(report)
    replica.manager.shutdown()


def _run_ft(
    width: int, depth: int, steps: int, kill_at: int = -1, heartbeat_ms: int = 1000
) -> list[Any]:
    """Two replica groups, a and b (b SIGKILLed at attempt ``kill_at`` if >= 0)."""
    # Both groups in the first quorum; after a death the survivor goes on alone.
    lighthouse, address = _lighthouse(2 if kill_at < 0 else 1, heartbeat_ms)
    ctx = mp.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Barrier(2)
    procs = [
        ctx.Process(
            target=_ft_replica,
            args=(
                name,
                address,
                width,
                depth,
                steps,
                kill_at if name == "b" else -1,
                results,
                ready,
            ),
        )
        for name in ("a", "b")
    ]
    try:
        for p in procs:
            p.start()
        # Two reports either way: the victim reports its death time instead of its steps.
        return [results.get(timeout=240) for _ in range(2)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def bench_overhead(width: int, depth: int, steps: int) -> dict[str, Any]:
    """Median step time of DDP and of 2 torchft replica groups, same model, one after the other."""
    ddp = run_on_ranks(_ddp_rank, 2, width, depth, steps, timeout_s=280)
    ft = _run_ft(width, depth, steps)
    ft_steps = [s["seconds"] for r in ft for s in r["steps"][2:]]
    ft_quorum = [s["quorum_s"] for r in ft for s in r["steps"][2:]]
    ddp_ms = statistics.median([t for r in ddp for t in r]) * 1e3
    ft_ms = statistics.median(ft_steps) * 1e3
    return {
        "bench": "overhead",
        "params": _params(width, depth),
        "ddp_step_ms": round(ddp_ms, 2),
        "ft_step_ms": round(ft_ms, 2),
        "ft_quorum_ms": round(statistics.median(ft_quorum) * 1e3, 2),
        "ft_over_ddp": round(ft_ms / ddp_ms, 3),
    }


def bench_recovery(width: int, depth: int, heartbeat_ms: int) -> dict[str, Any]:
    """Seconds from one group's SIGKILL (inside the all-reduce) to the survivor's next commit."""
    results = _run_ft(width, depth, steps=20, kill_at=5, heartbeat_ms=heartbeat_ms)
    killed = next(r["killed_at"] for r in results if "killed_at" in r)
    survivor = next(r for r in results if "commits" in r)
    after = [t for t in survivor["commits"] if t > killed]
    return {
        "bench": "recovery",
        "heartbeat_timeout_s": heartbeat_ms / 1e3,
        "death_to_next_commit_s": round(after[0] - killed, 3) if after else None,
    }


def _heal_source(address: str, width: int, depth: int, ready: Any, stop: Any) -> None:
    replica = _Replica("a", address, width, depth)
    while not stop.is_set():
        replica.optim.zero_grad()
        replica.forward_backward(8)
        replica.optim.step()
        if replica.manager.current_step() == 3:
            ready.set()
    replica.manager.shutdown()


def _heal_target(address: str, width: int, depth: int, results: Any) -> None:
    replica = _Replica("b", address, width, depth)
    start = time.perf_counter()
    replica.optim.zero_grad()  # joins the quorum and heals inside
    heal_s = time.perf_counter() - start
    replica.forward_backward(8)
    replica.optim.step()  # a full step, so that the source's all-reduce has its peer
    manager = replica.manager
    results.put(
        {"heal_s": heal_s, "step": manager.current_step(), "error": repr(manager.errored())}
    )
    manager.shutdown()


def bench_heal(width: int, depth: int) -> dict[str, Any]:
    """Seconds for a fresh group's first ``zero_grad`` (quorum, state fetched and loaded)."""
    lighthouse, address = _lighthouse(1)
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    source = ctx.Process(target=_heal_source, args=(address, width, depth, ready, stop))
    target = ctx.Process(target=_heal_target, args=(address, width, depth, results))
    try:
        source.start()
        ready.wait(timeout=120)
        target.start()
        result = results.get(timeout=280)
    finally:
        stop.set()
        for p in (target, source):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    params = _params(width, depth)
    # Model + AdamW's two moments, float32.
    return {
        "bench": "heal",
        "params": params,
        "state_mb": round(params * 12 / 2**20, 1),
        **result,
        "heal_s": round(result["heal_s"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    """Run every benchmark and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--rounds", type=int, default=1, help="overhead rounds per size")
    args = parser.parse_args(argv)
    sizes = [(256, 2)] if args.quick else [(256, 2), (1024, 4)]
    for width, depth in sizes:
        for _ in range(args.rounds):
            row = bench_overhead(width, depth, steps=10 if args.quick else 30)
            print(json.dumps(row), flush=True)
    for heartbeat_ms in [1000] if args.quick else [500, 1000, 2000]:
        print(json.dumps(bench_recovery(256, 2, heartbeat_ms)), flush=True)
    heal_sizes = [(512, 2)] if args.quick else [(512, 2), (1024, 8), (2048, 8)]
    for width, depth in heal_sizes:
        print(json.dumps(bench_heal(width, depth)), flush=True)


if __name__ == "__main__":
    main()
