"""The fault-tolerance contract on torchft: its Rust lighthouse, started here, and 2-3 groups.

Each replica group runs under `run_on_ranks` (in a thread of this process, so groups run side
by side) on `TorchftManager`; tests/ft_torchft_groups.py is what every group does. Every
scenario ends with the groups' states compared by digest at the last step, and checks what the
scenario is about: a dropped step restores fused tables and optimizer state bit for bit and
retrains its batch; a NaN is dropped on every group; a killed group (or one rank of it) rejoins
and heals; a lighthouse restart loses no sample; sharded groups (2 ranks each) do all of the
above per rank; a group trained by the pipeline (id-mapped tables, sharded or not) ends in
the state of its plain-loop peer. Each spawn of a lighthouse and its groups covers several
scenarios.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

import pytest

pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")

import ft_lighthouse  # noqa: E402
from ft_torchft_groups import Scenario, replica_group  # noqa: E402

from recopt.testing import RankFailure, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess


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


@pytest.mark.parametrize(
    "groups, ranks, id_map, pipelined",
    [
        (3, 1, False, ""),
        (2, 1, True, ""),
        (2, 2, False, ""),
        (2, 2, True, ""),
        (2, 1, True, "B"),
        (2, 2, True, "B"),
    ],
    ids=[
        "3-groups-plain",
        "2-groups-plain-id-map",
        "2-groups-sharded",
        "2-groups-sharded-id-map",
        "2-groups-plain-id-map-B-pipelined",
        "2-groups-sharded-id-map-B-pipelined",
    ],
)
def test_dropped_and_nonfinite_steps_restore_state(
    groups: int, ranks: int, id_map: bool, pipelined: str
) -> None:
    """Every group drops position 1 (an injected error after backward, whose fused update
    moved the tables): all roll back bit for bit and retrain it. Only A's input at position 3
    holds a NaN: every group sees it in the exchanged gradients, drops the step and skips that
    batch (it would fail again). The groups named in ``pipelined`` train through
    `TrainPipelineSparseDist` (their next batches distributed and, sharded, their ids routed
    to the owner shards while a step trains; a dropped step's batch retrained from them) and
    must end in the plain loop's state."""
    server = ft_lighthouse.in_process(min_replicas=groups)
    try:
        address = ft_lighthouse.address(server)
        specs = [
            Scenario(
                replica_id=name,
                lighthouse=address,
                steps=5,
                seed=seed,
                drop_at=1,
                nan_at=3 if name == "A" else None,
                id_map=id_map,
                pipeline=name in pipelined,
            )
            for name, seed in list(zip("ABC", (1, 2, 3), strict=True))[:groups]
        ]
        results = _run_groups(specs, ranks)
    finally:
        server.shutdown()
    for result in results:
        assert not isinstance(result, Exception), result
    for rank in range(ranks):
        logs = [result[rank] for result in results]
        for log in logs:
            assert _check_dropped_restored(log) == 2
            dropped = [(e["position"], e["error"]) for e in log if not e["committed"]]
            assert dropped == [(1, "RuntimeError"), (3, "NonFiniteGradientError")], log
            injected = next(e for e in log if e["error"] == "RuntimeError")
            assert injected["after_backward"] != injected["before"]  # rows were updated ...
            assert injected["after"] == injected["before"]  # ... and restored
            assert [e["position"] for e in log if e["committed"]] == [0, 1, 2, 4, 5]
            assert all(e["participants"] == groups for e in log), log
        digests = _final_digests(logs, 4)
        assert len(set(digests)) == 1, f"rank {rank}: replica groups differ: {digests}"


@pytest.mark.parametrize(
    "ranks, id_map",
    [(1, False), (1, True), (2, False), (2, True)],
    ids=["plain", "plain-id-map", "sharded", "sharded-id-map"],
)
def test_killed_group_rejoins_and_heals(tmp_path: Any, ranks: int, id_map: bool) -> None:
    """B dies mid-step (after its fused update, before the vote: the whole group, or one rank
    of a sharded group); A drops that step, rolls back and trains on alone; B restarts, heals
    from A (each rank from the same rank) and both end with equal digests."""
    server = ft_lighthouse.in_process(min_replicas=1)
    first, back = str(tmp_path / "B-first"), str(tmp_path / "B-back")
    address = ft_lighthouse.address(server)
    common: dict[str, Any] = {
        "lighthouse": address,
        "steps": 7,
        "step_sleep": 0.05,
        "id_map": id_map,
    }
    a_spec = Scenario(replica_id="A", seed=1, waits=((0, first), (4, back)), **common)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            survivor = pool.submit(_run_groups, [a_spec], ranks)
            b_spec = Scenario(replica_id="B", seed=2, crash_at=2, ready_file=first, **common)
            (crashed,) = _run_groups([b_spec], ranks)
            assert isinstance(crashed, RankFailure), crashed  # B exited mid-step
            b_spec = Scenario(replica_id="B", seed=2, ready_file=back, **common)
            (rejoined,) = _run_groups([b_spec], ranks)
            (survived,) = survivor.result()
    finally:
        server.shutdown()
    assert not isinstance(rejoined, Exception), rejoined
    assert not isinstance(survived, Exception), survived
    for rank in range(ranks):
        a_log, b_log = survived[rank], rejoined[rank]
        # Every step A dropped (the one B died in, when A was in it with B) was rolled back.
        _check_dropped_restored(a_log)
        # B's restart healed to A's step (at least 4: A waited for it there), not step 0.
        assert b_log[0]["step"] >= 4, b_log[0]
        # ... to A's exact state there: weights, fused tables and their Adam state, dense Adam.
        a_at = {e["step"]: e["before"] for e in a_log if e["participants"] == 2}
        assert b_log[0]["before"] == a_at[b_log[0]["step"]], (a_log, b_log)
        digests = _final_digests([a_log, b_log], 6)
        assert digests[0] == digests[1], f"rank {rank}: replica groups differ"


def test_lighthouse_restart_and_a_hung_group_lose_no_sample(tmp_path: Any) -> None:
    """torchft_lighthouse killed for 5 s mid-run: steps drop, retry their batch, none is lost.
    Later B hangs mid-step (still heartbeating) for longer than the collective timeout: A's
    all-reduce times out and A drops the step; torchft's next quorum waits for B (alone, A is
    no majority of the two live groups), B's late step is dropped too, and both retrain it."""
    port = ft_lighthouse.free_port()
    lighthouse = ft_lighthouse.start_process(port, min_replicas=2)
    at3 = str(tmp_path / "at3")
    steps = 8
    specs = [
        Scenario(
            replica_id=name,
            lighthouse=f"http://127.0.0.1:{port}",
            steps=steps,
            seed=seed,
            step_sleep=0.2,
            marks=((3, at3),),
            timeout_s=8.0,
            hang_at=6 if name == "B" else None,
            hang_s=11.0,
        )
        for name, seed in (("A", 1), ("B", 2))
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_run_groups, specs, 1)
            deadline = time.monotonic() + 120
            while not os.path.exists(at3) and time.monotonic() < deadline:
                time.sleep(0.05)
            lighthouse.kill()  # an outage of 5 s in the middle of the run
            lighthouse.wait(10)
            time.sleep(5)
            lighthouse = ft_lighthouse.start_process(port, min_replicas=2)
            results = running.result()
    finally:
        lighthouse.kill()
        lighthouse.wait(10)
    for result in results:
        assert not isinstance(result, Exception), result
    logs = [result[0] for result in results]
    for log in logs:
        assert _check_dropped_restored(log) >= 2  # the outage's failed quorum, the hang
        _check_every_sample_once(log, steps)
        hung = next(e for e in log if e["position"] == 6)
        assert not hung["committed"] and hung["error"] is not None, log
    digests = _final_digests(logs, steps - 1)
    assert digests[0] == digests[1]
