"""Sharded replica groups (2 groups x 2 ranks, DLRM under DistributedModelParallel).

Each rank's `FusedEmbeddingGuard` snapshots the rows its local kernels receive; healing hands
each rank the local shards of the same rank of a healthy group; rank r averages with rank r
of the other group. Processes: a lighthouse and four `tests/ft_sharded_worker.py` ranks, all
killed at the end.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ft_cluster import ROOT, Cluster, wait_for

from recopt.ft.healing import into_local_shards, to_local_shards
from recopt.sharding.state import make_sharded_tensor

pytestmark = pytest.mark.timeout(300)

WORKER = ROOT / "tests" / "ft_sharded_worker.py"


def _entries(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _committed(out: Path, name: str) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in _entries(out, name) if e["committed"]}


@pytest.mark.multiprocess
def test_sharded_groups_heal_drop_and_lose_a_rank(tmp_path: Path) -> None:
    """a trains alone to step 2, then b (other seed) joins there and heals rank by rank; at
    step 4 every rank drops the step: local shards and optimizer state come back bit-identical
    although backward had changed them; the groups agree rank by rank on every joint step.
    Then one rank of b is SIGKILLed: b's other rank never commits again, and a goes on alone
    as soon as the dead rank's heartbeat expires (1 s), not after the 20 s collective timeout.
    """
    cluster = Cluster(tmp_path)
    try:
        cluster.start_lighthouse(min_replicas=1, join_s=1.0, hb_s=1.0)
        common = [f"--lighthouse-port={cluster.port}", f"--out={tmp_path}", "--drop-at=4"]
        hold = tmp_path / "b.go"  # b builds its model meanwhile, then joins at a's step 2
        groups = (("a", 1, ["--wait-peers-at=2", "--steps=10"]), ("b", 2, [f"--hold-file={hold}"]))
        for replica, seed, extra in groups:
            for rank in (0, 1):
                args = [f"--replica-id={replica}", f"--group-rank={rank}", f"--seed={seed}"]
                args += ["--step-sleep=0.2", "--steps=40", *common, *extra]
                cluster.start_script(f"{replica}-r{rank}", WORKER, *args)
        wait_for(lambda: 1 in _committed(tmp_path, "a-r1"), 120, "a's step 1")
        hold.write_text("")
        wait_for(lambda: 6 in _committed(tmp_path, "b-r1"), 120, "b's joint step 6")
        cluster.kill("b-r1")
        assert cluster.replicas["a-r0"].wait(timeout=120) == 0, cluster.logs()
        assert cluster.replicas["a-r1"].wait(timeout=60) == 0, cluster.logs()
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
            a_done, b_done = (_committed(tmp_path, f"{g}-r{rank}") for g in "ab")
            joint = sorted(k for k in b_done if a_done[k]["participants"] == 2)
            assert joint[0] == 2 and joint[-1] >= 6, joint
            for k in joint:
                assert a_done[k]["after_vote"] == b_done[k]["after_vote"], k
        # After the kill: b's surviving rank commits nothing; a commits alone, soon.
        killed_at = max(_committed(tmp_path, "b-r1"))
        assert max(_committed(tmp_path, "b-r0")) <= killed_at + 1
        a0 = _committed(tmp_path, "a-r0")
        assert max(a0) == 9 and a0[9]["participants"] == 1
        last_joint = max(k for k, e in a0.items() if e["participants"] == 2)
        assert all(a0[k]["participants"] == 1 for k in range(last_joint + 1, 10))
        first_alone = a0[last_joint + 1]["time"]
        last_joint_time = a0[last_joint]["time"]
        assert 0 < first_alone - last_joint_time < 8.0, (last_joint_time, first_alone)
        # The ranks hold different shards: the lanes are not mixed up.
        assert a0[9]["after_vote"] != _committed(tmp_path, "a-r1")[9]["after_vote"]
    finally:
        cluster.close()


def test_local_shards_travel_as_plain_tensors_and_land_in_place(tmp_path: Path) -> None:
    """`to_local_shards` / `into_local_shards` round trip (world size 1, in process)."""

    def table(a: torch.Tensor, b: torch.Tensor) -> Any:
        pieces = [([0, 0], [2, 4], 0, a), ([2, 0], [3, 4], 0, b)]  # two row shards
        return make_sharded_tensor(pieces, [5, 4], 0, None)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        source = {"w": table(torch.ones(2, 4), torch.full((3, 4), 2.0)), "step": 3, "x": [1.5]}
        buffer = io.BytesIO()
        torch.save(to_local_shards(source), buffer)
        buffer.seek(0)
        received = torch.load(buffer, weights_only=True)  # no ShardedTensor inside
        mine = [torch.zeros(2, 4), torch.zeros(3, 4)]
        current = {"w": table(*mine), "step": 0, "x": [0.0]}
        loaded = into_local_shards(received, current)
        assert loaded["w"] is current["w"] and loaded["step"] == 3 and loaded["x"] == [1.5]
        assert torch.equal(mine[0], torch.ones(2, 4))  # copied into the live shard tensors
        assert torch.equal(mine[1], torch.full((3, 4), 2.0))
        whole = [([0, 0], [5, 4], 0, torch.zeros(5, 4))]  # one shard: another plan
        other_plan = {"w": make_sharded_tensor(whole, [5, 4], 0, None)}
        with pytest.raises(ValueError, match="same sharding plan"):
            into_local_shards(received, other_plan)
        with pytest.raises(ValueError, match="same sharding plan"):
            into_local_shards(received, {"w": torch.zeros(5, 4)})
    finally:
        dist.destroy_process_group()
