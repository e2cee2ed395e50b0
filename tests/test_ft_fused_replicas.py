"""Two replica groups with fused embedding tables stay bit-identical, batches differing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ft_cluster import Cluster, assert_same_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_fused_tables_stay_identical_across_replicas(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.run_fused_replicas()
        steps = cluster.steps_saved("a")
        assert steps == cluster.steps_saved("b") == set(range(1, 9))
        first = cluster.state("a", 1)
        last = cluster.state("a", 8)
        # Training moved both tables (each replica touched rows the other did not).
        for table in ("t0", "t1"):
            key = f"sparse.embedding_bags.{table}.weight"
            assert not torch.equal(first["model"][key], last["model"][key])
        for k in sorted(steps):
            assert_same_state(cluster.state("a", k), cluster.state("b", k))
    finally:
        cluster.close()
        print(cluster.logs())  # shown by pytest for a failed test only
