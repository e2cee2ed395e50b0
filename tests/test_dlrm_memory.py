"""The DLRM script on N ranks builds its tables on the meta device and allocates only each
rank's shards, after checking that they fit in the host's memory (issue 29, item 1)."""

from __future__ import annotations

import datetime
import pathlib
import sys
from typing import Any

import pytest
import torch

from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_build  # noqa: E402
import dlrm_config  # noqa: E402
import dlrm_memory  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)
OVERRIDES = [
    "embedding.tables.0.num_embeddings=300000",
    "embedding.optimizer.name=adam",  # element-wise state: two floats per weight
    "training.timeout_s=60",
]


def _local_bytes(obj: Any) -> int:
    """Bytes of every local tensor (a sharded one: its local shards) in a nested state dict."""
    if isinstance(obj, dict):
        return sum(_local_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_local_bytes(v) for v in obj)
    if hasattr(obj, "local_shards"):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in obj.local_shards())
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        return obj.numel() * obj.element_size()
    return 0


def _shard(rank: int, world_size: int) -> dict[str, Any]:
    config = dlrm_config.load_config(None, OVERRIDES)
    env = dlrm_build.RunEnv(rank=rank, world_size=world_size, local_world_size=world_size)
    model = dlrm_build.build_model(config, env.device, embeddings_on_meta=True)
    on_meta = all(p.is_meta for p in model.embedding_bags.parameters())
    dense_on_cpu = all(p.device.type == "cpu" for p in model.top_mlp.parameters())
    sharded = dlrm_build.shard_model(model, config, env)
    collection = sharded.plain_module.embedding_bags
    tables = {k: v for k, v in collection.state_dict().items() if "weight" in k}
    state = collection.fused_optimizer.state_dict()["state"]
    planned = dlrm_memory.shard_bytes(
        sharded.plan["embedding_bags"], config.embedding.tables, config.embedding.optimizer, rank
    )
    too_small = ""
    try:
        dlrm_memory.check_host_memory(
            sharded.plan["embedding_bags"],
            config.embedding.tables,
            config.embedding.optimizer,
            sharded.plain_module.top_mlp,
            [0, 1],
            TIMEOUT,
            available=(planned // 2, "a test's figure") if rank == 1 else None,
        )
    except MemoryError as err:
        too_small = str(err)
    return {
        "on_meta": on_meta,
        "dense_on_cpu": dense_on_cpu,
        "allocated": _local_bytes(tables) + _local_bytes(state),
        "planned": planned,
        "too_small": too_small,
    }


@pytest.mark.multiprocess
def test_each_rank_allocates_only_the_planned_shards() -> None:
    results = run_on_ranks(_shard, 2, timeout_s=240)
    full = 300_000 * 16 * 4 * 3  # the largest table's weights and Adam's two states
    for result in results:
        assert result["on_meta"] and result["dense_on_cpu"]
        assert result["allocated"] == result["planned"]  # the plan's bytes are what is allocated
    assert sum(r["planned"] for r in results) < 2 * full  # not a whole model on every rank
    # Rank 1 reports too little memory: every rank refuses, naming both figures and the fix.
    for result in results:
        assert "the embedding shards do not fit in memory" in result["too_small"]
        assert "GiB of table weights and optimizer state" in result["too_small"]
        assert "embedding.weight_dtype" in result["too_small"]
    assert "a test's figure" in results[1]["too_small"]


def test_one_host_check_counts_every_local_rank() -> None:
    config = dlrm_config.load_config(None, OVERRIDES)
    from recopt.sharding import construct_module_sharding_plan, row_wise

    tables = list(config.embedding.tables)
    plan = construct_module_sharding_plan(tables, {t.name: row_wise() for t in tables}, 2)
    per_rank = [
        dlrm_memory.shard_bytes(plan, tables, config.embedding.optimizer, r) for r in (0, 1)
    ]
    rows = sum(t.num_embeddings * t.embedding_dim for t in tables)
    assert sum(per_rank) == rows * 4 * 3  # fp32 weights + Adam's exp_avg and exp_avg_sq
    empty = torch.nn.Linear(1, 1, bias=False)
    dense = 4 * dlrm_memory.DENSE_COPIES
    needed = sum(per_rank) + 2 * dense
    dlrm_memory.check_host_memory(
        plan, tables, config.embedding.optimizer, empty, [0, 1], TIMEOUT, (needed, "exact")
    )
    with pytest.raises(MemoryError, match=r"ranks \[0, 1\] .* GiB .* is available \(tight\)"):
        dlrm_memory.check_host_memory(
            plan, tables, config.embedding.optimizer, empty, [0, 1], TIMEOUT, (needed - 1, "tight")
        )
    assert dlrm_memory.host_ranks(5, 4, 8) == [4, 5, 6, 7]


def test_a_meta_collection_measures_no_backend() -> None:
    # Backend.AUTO used to run its probe kernels on the meta device (and fail: no data); a
    # collection built there is a placeholder that the sharded module replaces.
    from recopt.kernels import Backend, FusedOptimizerConfig
    from recopt.kernels.config import TableSpec
    from recopt.kernels.factory import resolve_backend

    tables = [TableSpec(name="t", num_embeddings=1000, embedding_dim=16)]
    auto = FusedOptimizerConfig(name="row_wise_adagrad", backend=Backend.AUTO)
    decision = resolve_backend(tables, auto, torch.device("meta"))
    assert decision.backend is Backend.RECOPT
    assert decision.reason == "meta device: nothing measured"
