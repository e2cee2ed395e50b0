"""Sharded replica groups (2 groups x 2 ranks, DLRM under DistributedModelParallel).

Each rank's `FusedEmbeddingGuard` snapshots the rows its local kernels receive; healing hands
each rank the local shards of the same rank of a healthy group. Processes: a lighthouse and
four `tests/ft_sharded_worker.py` ranks, all killed at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ft_cluster import ROOT, Cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]

WORKER = ROOT / "tests" / "ft_sharded_worker.py"


def _entries(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


def test_sharded_groups_drop_restore_and_heal_local_shards(tmp_path: Path) -> None:
    """a trains alone to step 2, then b (other seed) joins there and heals rank by rank; at
    step 4 every rank drops the step: local shards and optimizer state come back bit-identical
    although backward had changed them; both groups then end equal, rank by rank."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start_lighthouse(min_replicas=1, join_s=2.0, hb_s=2.0)
        common = [f"--lighthouse-port={cluster.port}", f"--out={tmp_path}", "--steps=7"]
        for replica, seed, extra in (("a", 1, "--wait-peers-at=2"), ("b", 2, "")):
            for rank in (0, 1):
                args = [str(WORKER), f"--replica-id={replica}", f"--group-rank={rank}"]
                args += [f"--seed={seed}", "--drop-at=4", *common, *([extra] if extra else [])]
                cluster.replicas[f"{replica}-r{rank}"] = cluster._spawn(
                    args, f"{replica}-r{rank}.log"
                )
        for name, proc in cluster.replicas.items():
            assert proc.wait(timeout=240) == 0, f"{name} failed\n{cluster.logs()}"
        for rank in (0, 1):
            a, b = (_entries(tmp_path, f"{g}-r{rank}") for g in "ab")
            # b healed at its first quorum to a's state at step 2, shard for shard.
            a_at = {e["step"]: e["after_quorum"] for e in a if e["participants"] == 2}
            assert b[0]["step"] == 2 and b[0]["after_quorum"] == a_at[2], (a, b)
            for entries in (a, b):
                drop = [e for e in entries if e["step"] == 4 and not e["committed"]]
                assert len(drop) == 1 and "injected" in drop[0]["error"]
                assert drop[0]["after_backward"] != drop[0]["after_quorum"]  # rows were updated
                assert drop[0]["after_vote"] == drop[0]["after_quorum"]  # ... and restored
            assert a[-1]["after_vote"] == b[-1]["after_vote"] and a[-1]["step"] == 6
        assert (
            _entries(tmp_path, "a-r0")[-1]["after_vote"]
            != _entries(tmp_path, "a-r1")[-1]["after_vote"]
        )  # the ranks hold different shards
    finally:
        cluster.close()
