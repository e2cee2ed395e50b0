"""Offline resharding and export: the output loads at the new world size exactly like online."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TABLES, ShardedTables, full_value
from safetensors import safe_open
from test_checkpoint_dist import ALL_DP, A, C, _load_and_check

from recopt.checkpoint import CheckpointError, read_manifest, save
from recopt.checkpoint.cli import main
from recopt.checkpoint.manifest import SafeFileSystemReader
from recopt.checkpoint.reshard import export_full, reshard, target_chunks
from recopt.sharding.plan import ParameterSharding, ShardingPlan, ShardingType, ShardSpec
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def plan_for_c(world: int) -> ShardingPlan:
    """Layout C (t0 column-wise, t1 data-parallel, t2 table-wise) as a plan."""
    rows0, dim0 = TABLES["t0"]
    rows2, dim2 = TABLES["t2"]
    cw = tuple(
        ShardSpec(rank=c % world, row_offset=0, num_rows=rows0, col_offset=c, num_cols=1)
        for c in range(dim0)
    )
    return ShardingPlan(
        {
            "ebc": {
                "t0": ParameterSharding(
                    sharding_type=ShardingType.COLUMN_WISE,
                    ranks=tuple(sorted({s.rank for s in cw})),
                    shards=cw,
                ),
                "t1": ParameterSharding(
                    sharding_type=ShardingType.DATA_PARALLEL, ranks=tuple(range(world))
                ),
                "t2": ParameterSharding(
                    sharding_type=ShardingType.TABLE_WISE,
                    ranks=(2 % world,),
                    shards=(
                        ShardSpec(
                            rank=2 % world,
                            row_offset=0,
                            num_rows=rows2,
                            col_offset=0,
                            num_cols=dim2,
                        ),
                    ),
                ),
            }
        }
    )


def _save_a(rank: int, world: int, root: str) -> None:
    model = ShardedTables(A, rank, world, seed=1)
    save(Path(root) / "a2", model, model.fused_optimizer, step=5)


def _load_both(rank: int, world: int, root: str) -> dict[str, list[str]]:
    return {
        name: _load_and_check(Path(root) / name, C, rank, world, 1) for name in ("a2", "r3", "cli3")
    }


def test_offline_reshard_loads_like_online(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_on_ranks(_save_a, 2, str(tmp_path), timeout_s=120)
    plan = plan_for_c(3)
    seen = []
    report = reshard(
        tmp_path / "a2",
        tmp_path / "r3",
        world_size=3,
        plan=plan,
        progress=lambda p: seen.append(p.done_tensors),
    )
    assert report.tables == 3 and report.tensors == 3 * 4 and seen[-1] == 12
    manifest = read_manifest(tmp_path / "r3")
    assert manifest.world_size == 3 and manifest.step == 5 and manifest.plan == plan.to_json()
    # The new chunks are the plan's rectangles: t0 in single columns, t1 whole.
    chunks = SafeFileSystemReader(tmp_path / "r3").read_metadata().state_dict_metadata
    assert sorted(
        tuple(c.offsets) for c in chunks["model/ebc.embedding_bags.t0.weight"].chunks
    ) == [(0, c) for c in range(4)]
    assert len(chunks["model/ebc.embedding_bags.t1.weight"].chunks) == 1

    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    args = [str(tmp_path / "a2"), str(tmp_path / "cli3"), "--world-size", "3"]
    assert main([*args, "--plan", str(plan_file)]) == 0
    out = capsys.readouterr()
    assert "(2 ranks) -> " in out.out and "(3 ranks): 12 tensors of 3 tables" in out.out
    assert "12/12 tensors" in out.err  # the progress bar
    for rank_result in run_on_ranks(_load_both, 3, str(tmp_path), timeout_s=120):
        assert rank_result == {"a2": [], "r3": [], "cli3": []}

    # No plan, down to one process: sharded tensors split by rows, loads without a group.
    reshard(tmp_path / "r3", tmp_path / "r1", world_size=1)
    assert _load_and_check(tmp_path / "r1", ALL_DP, 0, 1, 1) == []
    assert main(args) == 2 and "exists; choose a new output" in capsys.readouterr().err


def test_export_full_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = ShardedTables(ALL_DP, 0, 1, seed=4)
    save(tmp_path / "ck", model, model.fused_optimizer, step=2)
    assert main([str(tmp_path / "ck"), str(tmp_path / "full"), "--to-full", "--quiet"]) == 0
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [f"ebc.embedding_bags.{t}.weight" for t in TABLES]
        for t in TABLES:
            assert torch.equal(
                f.get_tensor(f"ebc.embedding_bags.{t}.weight"), full_value(t, "weight", 4)
            )
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
