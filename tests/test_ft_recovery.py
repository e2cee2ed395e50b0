"""Fault tolerance with real processes: a lighthouse and replica groups, killed and restarted.

Sharded groups (several ranks per group, a rank killed) are in tests/test_ft_sharded.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ft_cluster import Cluster, assert_same_state, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        print(c.logs())  # pytest shows captured teardown output for failed tests only


def _committed(cluster: Cluster, replica: str) -> list[dict]:
    return [e for e in cluster.entries(replica) if e["committed"]]


def test_kill_in_allreduce_then_heal(cluster: Cluster) -> None:
    cluster.start_lighthouse(min_replicas=1, join_s=1.0, hb_s=1.0)
    # Different seeds: identical states after step 1 prove the initial sync.
    cluster.start_replica("a", "--wait-live=2", seed=1)
    cluster.start_replica("b", "--wait-live=2", "--pause-at=3", "--pause-s=60", seed=2)
    wait_for((cluster.out / "b.paused").exists, 60, "replica b inside its all-reduce")
    wait_for(lambda: len(cluster.entries("a")) >= 3, 10, "a's first three steps")
    cluster.kill("b")

    def a_failed_step() -> dict | None:
        return next((e for e in cluster.entries("a") if e["step_before"] == 3), None)

    wait_for(a_failed_step, 30, "a's step after the kill")
    failed = a_failed_step()
    assert failed is not None
    assert failed["participants"] == 2 and not failed["committed"], failed
    assert failed["error"] is not None, failed
    assert failed["step_after"] == 3
    # Parameters and AdamW state (moments, step) are bit-identical after the dropped step.
    assert failed["digest_after"] == failed["digest_before"]

    wait_for(lambda: any(e["participants"] == 1 for e in _committed(cluster, "a")), 30, "a alone")
    alone = next(e for e in _committed(cluster, "a") if e["participants"] == 1)
    assert alone["step_before"] == 3 and alone["step_after"] == 4

    # Restarted with yet another seed: it must heal to a's step and state.
    cluster.start_replica("b", seed=3)
    wait_for(lambda: cluster.entries("b")[3:], 60, "restarted b's first step")
    first = cluster.entries("b")[3]
    assert first["step_before"] == 0 and first["healed_to"] >= 4, first
    heal_step = first["healed_to"]
    a_same = [
        e for e in cluster.entries("a") if e["healed_to"] == heal_step and e["participants"] == 2
    ]
    assert a_same and a_same[0]["digest_before"] == first["digest_before"]

    wait_for(lambda: max(cluster.steps_saved("b")) >= heal_step + 6, 60, "six joint steps")
    cluster.stop()
    common = cluster.steps_saved("a") & cluster.steps_saved("b")
    assert {1, 2, 3} <= common
    joint = [k for k in common if k > heal_step]
    assert len(joint) >= 6, joint
    for k in sorted(common):
        assert_same_state(cluster.state("a", k), cluster.state("b", k))
    a_joint = [e for e in _committed(cluster, "a") if e["step_before"] >= heal_step]
    assert all(e["participants"] == 2 for e in a_joint[:6])


def test_hung_replica_times_out(cluster: Cluster) -> None:
    cluster.start_lighthouse(min_replicas=1, join_s=1.0, hb_s=1.0)
    cluster.start_replica("a", "--wait-live=2", "--timeout-s=2", seed=1)
    # b hangs in its all-reduce at step 2 while still heartbeating (a stuck compute, not a crash).
    cluster.start_replica(
        "b", "--wait-live=2", "--timeout-s=2", "--pause-at=2", "--pause-s=6", seed=2
    )

    def a_at(step: int) -> dict | None:
        return next((e for e in cluster.entries("a") if e["step_before"] == step), None)

    wait_for(lambda: a_at(2), 60, "a's step 2")
    hung = a_at(2)
    assert hung is not None and not hung["committed"] and hung["error"] is not None, hung
    assert hung["digest_after"] == hung["digest_before"]
    assert "timed out" in hung["error"].lower(), hung  # the collective's own timeout
    assert 1.5 < hung["seconds"] < 5.5, hung  # 2 s timeout, well before b wakes (6 s)
    wait_for(lambda: any(e["participants"] == 1 for e in _committed(cluster, "a")), 30, "a alone")
    # b wakes up, its late step is dropped, and it heals and rejoins.
    wait_for(
        lambda: any(e["healed_to"] > e["step_before"] for e in cluster.entries("b")), 60, "b heals"
    )
    b_late = next(e for e in cluster.entries("b") if e["step_before"] == 2)
    assert not b_late["committed"]
    healed = next(e for e in cluster.entries("b") if e["healed_to"] > e["step_before"])
    wait_for(lambda: max(cluster.steps_saved("b")) >= healed["healed_to"] + 3, 60, "joint steps")
    cluster.stop()
    common = cluster.steps_saved("a") & cluster.steps_saved("b")
    assert len([k for k in common if k > healed["healed_to"]]) >= 3
    for k in sorted(common):
        assert_same_state(cluster.state("a", k), cluster.state("b", k))


def test_no_commit_below_min_replica_size(cluster: Cluster) -> None:
    cluster.start_lighthouse(min_replicas=1, join_s=0.5, hb_s=1.0)
    cluster.start_replica("a", "--wait-live=2", "--min-replica-size=2", seed=1)
    cluster.start_replica("b", "--wait-live=2", "--min-replica-size=2", seed=1)
    wait_for(lambda: len(_committed(cluster, "a")) >= 2, 60, "two joint commits")
    cluster.kill("b")
    wait_for(
        lambda: len([e for e in cluster.entries("a") if e["participants"] == 1]) >= 3, 30, "a alone"
    )
    alone = [e for e in cluster.entries("a") if e["participants"] == 1]
    assert all(not e["committed"] and e["step_after"] == e["step_before"] for e in alone)
    assert all(e["digest_after"] == e["digest_before"] for e in alone)
    assert len({e["step_after"] for e in alone}) == 1  # the step counter never moved
