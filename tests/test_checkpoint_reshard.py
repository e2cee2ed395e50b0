"""Offline resharding and export in one process (the multi-rank reshard round trip is in
test_checkpoint_dist): chunk layout, safetensors export, refusals of damaged input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import ALL_DP, TABLES, ShardedTables, full_value, load_and_check, plan_for_c
from safetensors import safe_open

from recopt.checkpoint import CheckpointError, save
from recopt.checkpoint.cli import main
from recopt.checkpoint.manifest import read_manifest
from recopt.checkpoint.reader import SafeFileSystemReader
from recopt.checkpoint.reshard import export_full, reshard, target_chunks
from recopt.sharding.plan import ShardingPlan


def test_reshard_chunks_follow_the_plan(tmp_path: Path) -> None:
    model = ShardedTables(ALL_DP, 0, 1, seed=4)
    save(tmp_path / "ck", model, model.fused_optimizer, step=2)
    reshard(tmp_path / "ck", tmp_path / "r3", world_size=3, plan=plan_for_c(3))
    chunks = SafeFileSystemReader(tmp_path / "r3").read_metadata().state_dict_metadata
    t0 = chunks["model/ebc.embedding_bags.t0.weight"]
    assert sorted(tuple(c.offsets) for c in t0.chunks) == [(0, c) for c in range(4)]
    assert len(chunks["model/ebc.embedding_bags.t1.weight"].chunks) == 1
    assert load_and_check(tmp_path / "r3", ALL_DP, 0, 1, 4) == []
    with pytest.raises(CheckpointError, match="exists; choose a new output"):
        reshard(tmp_path / "ck", tmp_path / "r3", world_size=2)
    with pytest.raises(ValueError, match="on rank 2, but --world-size is 2"):
        reshard(tmp_path / "ck", tmp_path / "r2", world_size=2, plan=plan_for_c(3))
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        reshard(tmp_path / "ck", tmp_path / "r0", world_size=0)
    # a plan for the tables under another module path (recopt-plan's default ""): refused,
    # naming both (it was ignored: even row splits, as if no plan were given)
    elsewhere = ShardingPlan({"": plan_for_c(3).plan["ebc"]})
    with pytest.raises(ValueError, match=r"does not have: t0, t1, t2 .*\[''\].*\['ebc'\]"):
        reshard(tmp_path / "ck", tmp_path / "r4", world_size=3, plan=elsewhere)
    assert not (tmp_path / "r4").exists()
    # the manifest's finite flag survives (a diverged checkpoint stays marked as such)
    with torch.no_grad():
        model.weights["t0"][0, 0] = float("nan")  # (data-parallel: a plain tensor)
    save(tmp_path / "nan", model, model.fused_optimizer, step=3)
    reshard(tmp_path / "nan", tmp_path / "nan3", world_size=3)
    assert read_manifest(tmp_path / "nan").finite is False
    assert read_manifest(tmp_path / "nan3").finite is False


def test_export_full_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = ShardedTables(ALL_DP, 0, 1, seed=4)
    save(tmp_path / "ck", model, model.fused_optimizer, step=2)
    assert main([str(tmp_path / "ck"), str(tmp_path / "full"), "--to-full", "--quiet"]) == 0
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        # A table once: <module>.<table>.weight, without the collection's embedding_bags dict.
        assert sorted(f.keys()) == [f"ebc.{t}.weight" for t in TABLES]
        for t in TABLES:
            assert torch.equal(f.get_tensor(f"ebc.{t}.weight"), full_value(t, "weight", 4))
        assert f.metadata()["step"] == "2"
    with safe_open(str(tmp_path / "full" / "state.safetensors"), "pt") as f:
        key = "optim/state/ebc.embedding_bags.t1.weight/t1.m1"
        assert torch.equal(f.get_tensor(key), full_value("t1", "m1", 4))
        assert f.get_tensor("optim/state/ebc.embedding_bags.t2.weight/t2.step").item() == 6.0

    shard = tmp_path / "ck" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp: corrupt: crc32"):
        export_full(tmp_path / "ck", tmp_path / "full2")
    assert main([str(tmp_path / "ck"), str(tmp_path / "r"), "--world-size", "2"]) == 2
    assert "corrupt: crc32" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "full2").exists()


def test_target_chunks_follow_the_plan() -> None:
    plan = plan_for_c(3)
    weight = "model/ebc.embedding_bags.t2.weight"
    assert target_chunks(weight, [12, 2], plan, 3, True) == [((0, 0), (12, 2))]
    row_state = "optim/state/ebc.embedding_bags.t0.weight/t0.m1"
    assert target_chunks(row_state, [10], plan, 3, True) == [((0,), (10,))]  # CW: rows once
    assert target_chunks("model/dense.weight", [7, 3], None, 3, True) == [
        ((0, 0), (3, 3)),
        ((3, 0), (3, 3)),
        ((6, 0), (1, 3)),
    ]
    assert target_chunks("model/dense.weight", [7, 3], None, 3, False) == [((0, 0), (7, 3))]
    assert target_chunks("optim/x/step", [], plan, 3, False) == [((), ())]


def _save_dmp_with_named_children(rank: int, world: int, root: str) -> None:
    from test_checkpoint_sharded import Model, plan, train

    from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
    from recopt.sharding.model_parallel import DistributedModelParallel

    model = DistributedModelParallel(Model(), plan("mixed", world))
    dense = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01)
    )
    # Named children: their state keys carry the names ("fused.<param>").
    opt = CombinedOptimizer([("fused", model.fused_optimizer), ("dense", dense)])
    train(model, opt, rank, range(2))  # type: ignore[arg-type]
    save(Path(root) / "ck", model, opt, step=2)


@pytest.mark.multiprocess
def test_reshard_of_a_dmp_checkpoint_with_named_optimizer_children(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from test_checkpoint_sharded import plan

    from recopt.checkpoint import read_manifest
    from recopt.testing import run_on_ranks

    run_on_ranks(_save_dmp_with_named_children, 2, str(tmp_path), timeout_s=240)
    state_keys = [k for k in read_manifest(tmp_path / "ck").tensors if k.startswith("optim/")]
    assert any("/fused." in k for k in state_keys), state_keys
    target = plan("row_wise", 3)
    target.save(str(tmp_path / "plan.json"))
    argv = [str(tmp_path / "ck"), str(tmp_path / "r3"), "--world-size", "3"]
    assert main([*argv, "--plan", str(tmp_path / "plan.json"), "--quiet"]) == 0
    assert "(3 embedding tables)" in capsys.readouterr().out
    chunks = SafeFileSystemReader(tmp_path / "r3").read_metadata().state_dict_metadata
    for table in ("t0", "t1", "t2"):
        weight = chunks[f"model/sparse.embedding_bags.{table}.weight"]
        rows = sorted(tuple(c.offsets)[0] for c in weight.chunks)
        assert len(rows) == 3  # row-wise over 3 ranks
        states = [k for k in chunks if "/fused." in k and k.endswith((".momentum1", ".momentum2"))]
        for key in (k for k in states if f"embedding_bags.{table}.weight" in k):
            assert sorted(tuple(c.offsets)[0] for c in chunks[key].chunks) == rows, key
