"""Fault-tolerance benchmarks: per-step overhead vs DDP, recovery time after a death, heal time.

Run: ``.venv/bin/python benchmarks/bench_ft.py [--quick] [--engines]``. Replicas are spawned
processes on this machine (gloo over loopback); the lighthouse runs in this process. Prints one
JSON line per measurement. ``--engines`` measures only the per-step overhead of recopt's own
engine and of torchft's (`TorchftManager`, the ``ft`` extra) side by side, rounds interleaved.
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

from recopt.ft import Manager, ManagerConfig, OptimizerWrapper
from recopt.ft.client import wait_for_replicas
from recopt.ft.lighthouse import Lighthouse, LighthouseConfig
from recopt.testing import run_on_ranks

TIMEOUT = datetime.timedelta(seconds=30)


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _params(width: int, depth: int) -> int:
    return depth * (width * width + width) + width + 1


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


def _manager(
    engine: str, replica_id: str, address: Any, state_dict: Any, load: Any, peers: int = 2
) -> Any:
    """A replica group's manager on ``engine``: "recopt" (address: port) or "torchft" (URL);
    on recopt's engine it waits until ``peers`` groups are live."""
    if engine == "torchft":
        from recopt.ft.torchft_manager import TorchftConfig, TorchftManager

        # The group's store (torchrun's role); kept alive by the manager that uses it.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        config = TorchftConfig(
            replica_id=replica_id,
            lighthouse_addr=address,
            store_addr="127.0.0.1",
            store_port=store.port,
            timeout=TIMEOUT,
            quorum_timeout=TIMEOUT,
        )
        manager = TorchftManager(config, state_dict=state_dict, load_state_dict=load)
        manager.group_store = store  # type: ignore[attr-defined]
        return manager
    config = ManagerConfig(
        replica_id=replica_id,
        lighthouse=("127.0.0.1", address),
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        hostname="127.0.0.1",
    )
    manager = Manager(config, state_dict=state_dict, load_state_dict=load)
    if peers > 1:
        wait_for_replicas(config.lighthouse, peers, TIMEOUT)
    return manager


def _ft_replica(
    replica_id: str,
    address: Any,
    width: int,
    depth: int,
    steps: int,
    kill_at: int,
    results: Any,
    engine: str = "recopt",
) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(width, depth)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = _manager(engine, replica_id, address, state_dict, load)
    optim = OptimizerWrapper(manager, inner)
    report: dict[str, Any] = {"replica": replica_id, "steps": [], "commits": []}
    for attempt in range(steps):
        start = time.perf_counter()
        quorum_start = time.perf_counter()
        optim.zero_grad()
        quorum_s = time.perf_counter() - quorum_start
        model(torch.randn(32, width)).pow(2).mean().backward()
        if attempt == kill_at:
            results.put({"replica": replica_id, "killed_at": time.time()})
            results.close()
            results.join_thread()  # flushed before the kill, or the message is lost
            os.kill(os.getpid(), signal.SIGKILL)  # the peer is now inside the all-reduce
        before = manager.current_step()
        optim.step()
        report["steps"].append(
            {
                "seconds": time.perf_counter() - start,
                "quorum_s": quorum_s,
                "n": manager.num_participants(),
            }
        )
        if manager.current_step() > before:
            report["commits"].append(time.time())
    results.put(report)
    manager.shutdown()


def _run_ft(width: int, depth: int, steps: int, kill_at: int = -1, hb_s: float = 1.0) -> list[Any]:
    config = LighthouseConfig(
        min_replicas=1,
        join_timeout=datetime.timedelta(seconds=1),
        heartbeat_timeout=datetime.timedelta(seconds=hb_s),
    )
    lighthouse = Lighthouse(config, host="127.0.0.1", port=0)
    lighthouse.start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_ft_replica,
            args=(
                name,
                lighthouse.port,
                width,
                depth,
                steps,
                kill_at if name == "b" else -1,
                results,
            ),
        )
        for name in ("a", "b")
    ]
    try:
        for p in procs:
            p.start()
        # Two reports either way: the victim reports its death time instead of its steps.
        return [results.get(timeout=120) for _ in range(2)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def _run_torchft(width: int, depth: int, steps: int) -> list[Any]:
    """Two replica groups on torchft's lighthouse (both in every quorum)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_ft_replica,
            args=(name, address, width, depth, steps, -1, results, "torchft"),
        )
        for name in ("a", "b")
    ]
    try:
        for p in procs:
            p.start()
        return [results.get(timeout=180) for _ in range(2)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def _median_ms(reports: list[Any], key: str) -> float:
    return statistics.median([s[key] for r in reports for s in r["steps"][2:]]) * 1e3


def bench_engines(width: int, depth: int, steps: int, rounds: int) -> dict[str, Any]:
    """Step time of recopt's engine and of torchft's, same model, rounds interleaved."""
    recopt_ms, torchft_ms, recopt_q, torchft_q = [], [], [], []
    for _ in range(rounds):
        ours = _run_ft(width, depth, steps)
        theirs = _run_torchft(width, depth, steps)
        recopt_ms.append(_median_ms(ours, "seconds"))
        torchft_ms.append(_median_ms(theirs, "seconds"))
        recopt_q.append(_median_ms(ours, "quorum_s"))
        torchft_q.append(_median_ms(theirs, "quorum_s"))
    recopt_step, torchft_step = statistics.median(recopt_ms), statistics.median(torchft_ms)
    return {
        "bench": "engines",
        "params": _params(width, depth),
        "rounds": rounds,
        "recopt_step_ms": round(recopt_step, 2),
        "torchft_step_ms": round(torchft_step, 2),
        "recopt_quorum_ms": round(statistics.median(recopt_q), 2),
        "torchft_quorum_ms": round(statistics.median(torchft_q), 2),
        "torchft_over_recopt": round(torchft_step / recopt_step, 3),
    }


def _round_trips(manager: Any, steps: int) -> tuple[float, float]:
    quorum, vote = [], []
    for _ in range(steps):
        start = time.perf_counter()
        manager.start_quorum()
        middle = time.perf_counter()
        manager.should_commit()
        quorum.append(middle - start)
        vote.append(time.perf_counter() - middle)
    return statistics.median(quorum[5:]) * 1e3, statistics.median(vote[5:]) * 1e3


def bench_round_trip(steps: int = 40) -> dict[str, Any]:
    """One replica group alone, no model: ms of ``start_quorum`` and ``should_commit``."""
    from torchft.coordination import LighthouseServer

    theirs = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    ours = Lighthouse(LighthouseConfig(min_replicas=1), host="127.0.0.1", port=0)
    ours.start()
    address = f"http://127.0.0.1:{theirs.address().rsplit(':', 1)[1]}"
    managers = {
        "torchft": _manager("torchft", "solo", address, dict, lambda s: None),
        "recopt": _manager("recopt", "solo", ours.port, dict, lambda s: None, peers=1),
    }
    row: dict[str, Any] = {"bench": "round_trip", "steps": steps}
    try:
        for name, manager in managers.items():
            quorum_ms, vote_ms = _round_trips(manager, steps)
            row[f"{name}_quorum_ms"], row[f"{name}_vote_ms"] = (
                round(quorum_ms, 3),
                round(vote_ms, 3),
            )
    finally:
        for manager in managers.values():
            manager.shutdown()
        ours.shutdown()
        theirs.shutdown()
    return row


def bench_overhead(width: int, depth: int, steps: int) -> dict[str, Any]:
    """Median step time of DDP and of the Manager on 2 replicas, same model."""
    ddp = run_on_ranks(_ddp_rank, 2, width, depth, steps, timeout_s=300)
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
        "overhead_ms": round(ft_ms - ddp_ms, 2),
    }


def bench_recovery(width: int, depth: int, hb_s: float) -> dict[str, Any]:
    """Seconds from one replica's SIGKILL (inside the all-reduce) to the survivor's next commit."""
    results = _run_ft(width, depth, steps=20, kill_at=5, hb_s=hb_s)
    killed = next(r["killed_at"] for r in results if "killed_at" in r)
    survivor = next(r for r in results if "commits" in r)
    after = [t for t in survivor["commits"] if t > killed]
    return {
        "bench": "recovery",
        "heartbeat_timeout_s": hb_s,
        "death_to_next_commit_s": round(after[0] - killed, 3) if after else None,
    }


def _heal_source(port: int, width: int, depth: int, ready: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    model = _model(width, depth)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ManagerConfig(
        replica_id="a",
        lighthouse=("127.0.0.1", port),
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        hostname="127.0.0.1",
    )
    manager = Manager(
        config,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        load_state_dict=lambda s: None,
    )
    optim = OptimizerWrapper(manager, inner)
    while not stop.is_set():
        optim.zero_grad()
        model(torch.randn(8, width)).pow(2).mean().backward()
        optim.step()
        if manager.current_step() == 3:
            ready.set()
    manager.shutdown()


def _heal_target(port: int, width: int, depth: int, results: Any) -> None:
    torch.set_num_threads(1)
    model = _model(width, depth)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ManagerConfig(
        replica_id="b",
        lighthouse=("127.0.0.1", port),
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        hostname="127.0.0.1",
    )

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        config,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        load_state_dict=load,
    )
    optim = OptimizerWrapper(manager, inner)
    start = time.perf_counter()
    optim.zero_grad()  # joins the quorum and heals inside
    heal_s = time.perf_counter() - start
    model(torch.randn(8, width)).pow(2).mean().backward()
    optim.step()  # a full step, so that the source's all-reduce has its peer
    result = {"heal_s": heal_s, "step": manager.current_step(), "error": repr(manager.errored())}
    results.put(result)
    manager.shutdown()


def bench_heal(width: int, depth: int) -> dict[str, Any]:
    """Seconds for a fresh replica to heal from a peer (quorum reply to state loaded)."""
    lighthouse = Lighthouse(LighthouseConfig(min_replicas=1), host="127.0.0.1", port=0)
    lighthouse.start()
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    source = ctx.Process(target=_heal_source, args=(lighthouse.port, width, depth, ready, stop))
    target = ctx.Process(target=_heal_target, args=(lighthouse.port, width, depth, results))
    try:
        source.start()
        ready.wait(timeout=120)
        target.start()
        result = results.get(timeout=300)
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
    parser.add_argument(
        "--engines", action="store_true", help="only recopt's engine vs torchft's, per step"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--engines)")
    args = parser.parse_args(argv)
    if args.engines:
        print(json.dumps(bench_round_trip()), flush=True)
        for width, depth in [(256, 2)] if args.quick else [(256, 2), (1024, 4)]:
            print(json.dumps(bench_engines(width, depth, 30, args.rounds)), flush=True)
        return
    rows = []
    sizes = [(256, 2)] if args.quick else [(256, 2), (1024, 4)]
    for width, depth in sizes:
        rows.append(bench_overhead(width, depth, steps=10 if args.quick else 30))
    for hb_s in [1.0] if args.quick else [0.5, 1.0, 2.0]:
        rows.append(bench_recovery(256, 2, hb_s))
    heal_sizes = [(512, 2)] if args.quick else [(512, 2), (1024, 8), (2048, 8), (4096, 4)]
    for width, depth in heal_sizes:
        rows.append(bench_heal(width, depth))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
