"""The fault-tolerance contract on torchft: its Rust lighthouse, started here, and 2 replica groups.

Each replica group runs under `run_on_ranks` (in a thread of this process, so groups run side
by side) on `TorchftManager`; tests/ft_torchft_groups.py is what every group does. Every
scenario ends with the groups' states compared by digest at the last step, and checks what the
scenario is about: a dropped step restores fused tables and optimizer state bit for bit and
retrains its batch; a NaN is dropped on every group; a killed group rejoins and heals; a
lighthouse restart loses no sample; sharded groups (2 ranks each) do all of the above per rank.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")

from ft_torchft_groups import Scenario, replica_group  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from recopt.testing import RankFailure, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _lighthouse(min_replicas: int, port: int = 0) -> Any:
    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=200,
        heartbeat_timeout_ms=1000,
    )


def _address(server: Any) -> str:
    port = int(server.address().rsplit(":", 1)[1])
    return f"http://127.0.0.1:{port}"


def _run_groups(specs: list[Scenario], ranks: int) -> list[Any]:
    """Each spec's group on ``ranks`` processes, side by side; a failure is returned."""

    def one(spec: Scenario) -> Any:
        try:
            return run_on_ranks(replica_group, ranks, spec, timeout_s=150)
        except RankFailure as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(one, specs))


def _final_digests(logs: list[list[dict[str, Any]]], step: int) -> list[str]:
    return [next(e["after"] for e in log if e["committed"] and e["step"] == step) for log in logs]


def _check_every_sample_once(log: list[dict[str, Any]], steps: int) -> None:
    trained = [e["position"] for e in log if e["committed"]]
    assert trained == list(range(steps)), trained


def _check_dropped_restored(log: list[dict[str, Any]]) -> int:
    dropped = [e for e in log if not e["committed"]]
    for entry in dropped:
        assert entry["after"] == entry["before"], entry
    return len(dropped)


@pytest.mark.parametrize("ranks", [1, 2], ids=["plain", "sharded"])
def test_dropped_step_restores_and_retrains_its_batch(ranks: int) -> None:
    server = _lighthouse(min_replicas=2)
    try:
        specs = [
            Scenario(replica_id=name, lighthouse=_address(server), steps=4, seed=seed, drop_at=1)
            for name, seed in (("A", 1), ("B", 2))
        ]
        results = _run_groups(specs, ranks)
    finally:
        server.shutdown()
    for result in results:
        assert not isinstance(result, Exception), result
    for rank in range(ranks):
        logs = [result[rank] for result in results]
        for log in logs:
            assert _check_dropped_restored(log) >= 1
            assert any(e["error"] == "RuntimeError" and not e["committed"] for e in log)
            _check_every_sample_once(log, 4)
        digests = _final_digests(logs, 3)
        assert digests[0] == digests[1], f"rank {rank}: replica groups differ"
