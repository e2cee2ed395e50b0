"""Checkpoints across world sizes and layouts (spawned gloo ranks), and a rank dying mid-save.

Hand-made ShardedTensors in table-wise, row-wise, column-wise and data-parallel layouts (several
column blocks on one rank, ranks without any shard); every loaded piece must equal the saved
model's values bit for bit, whatever the layouts and world sizes on either side, and a
checkpoint resharded offline (API and CLI) must load exactly like the original.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
from checkpoint_helpers import ALL_DP, A, B, C, ShardedTables, load_and_check, plan_for_c

from recopt.checkpoint import read_manifest, save
from recopt.checkpoint.cli import main
from recopt.checkpoint.reshard import reshard
from recopt.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multiprocess


def _two_ranks(rank: int, world: int, root: str) -> dict[str, list[str]]:
    out = {}
    model = ShardedTables(A, rank, world, seed=1)
    save(Path(root) / "a2", model, model.fused_optimizer, step=1, plan_json='{"x": 1}')
    for name, layouts in {"same": A, "b": B, "c": C}.items():
        out[f"2->2 {name}"] = load_and_check(Path(root) / "a2", layouts, rank, world, 1)
    model = ShardedTables(B, rank, world, seed=2)
    save(Path(root) / "b2", model, model.fused_optimizer, step=2)
    out["2->2 b->a"] = load_and_check(Path(root) / "b2", A, rank, world, 2)
    return out


def _three_ranks(rank: int, world: int, root: str) -> dict[str, list[str]]:
    out = {}
    for name, layouts in {"a": A, "b": B, "c": C}.items():
        out[f"2->3 a->{name}"] = load_and_check(Path(root) / "a2", layouts, rank, world, 1)
    out["2->3 b->c"] = load_and_check(Path(root) / "b2", C, rank, world, 2)
    for offline in ("r3", "cli3"):
        out[f"offline {offline}"] = load_and_check(Path(root) / offline, C, rank, world, 1)
    model = ShardedTables(C, rank, world, seed=3)
    save(Path(root) / "c3", model, model.fused_optimizer, step=3)
    out["3->3 c->a"] = load_and_check(Path(root) / "c3", A, rank, world, 3)
    return out


def test_round_trips_across_layouts_and_world_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = run_on_ranks(_two_ranks, 2, str(tmp_path), timeout_s=120)
    # Offline, between the two groups: 2 ranks (layout A) -> 3 ranks (layout C's plan).
    plan = plan_for_c(3)
    seen: list[int] = []
    report = reshard(
        tmp_path / "a2",
        tmp_path / "r3",
        world_size=3,
        plan=plan,
        progress=lambda p: seen.append(p.done_tensors),
    )
    assert report.tables == 3 and report.tensors == 3 * 4 and seen[-1] == 12
    resharded = read_manifest(tmp_path / "r3")
    assert resharded.world_size == 3 and resharded.step == 1 and resharded.plan == plan.to_json()
    plan.save(tmp_path / "plan.json")
    args = [str(tmp_path / "a2"), str(tmp_path / "cli3"), "--world-size", "3"]
    assert main([*args, "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr()
    assert "(2 ranks) -> " in out.out and "(3 ranks): 12 tensors (3 embedding tables)" in out.out
    assert "12/12 tensors" in out.err  # the progress bar
    assert main(args) == 2 and "exists; choose a new output" in capsys.readouterr().err

    results += run_on_ranks(_three_ranks, 3, str(tmp_path), timeout_s=120)
    for rank_result in results:
        for case, bad in rank_result.items():
            assert bad == [], f"{case}: {bad}"
    manifest = read_manifest(tmp_path / "a2")
    assert manifest.world_size == 2 and manifest.step == 1 and manifest.plan == '{"x": 1}'
    assert manifest.tensors["ebc.embedding_bags.t1.weight/t1.m1".join(["optim/state/", ""])]
    assert manifest.tensors["model/ebc.embedding_bags.t0.weight"].shape == [10, 4]
    # 3 -> 1 without any process group: every table data-parallel (plain tensors); and an
    # offline reshard with no plan down to 1 rank (sharded tensors split by rows).
    reshard(tmp_path / "r3", tmp_path / "r1", world_size=1)
    for path, seed in ((tmp_path / "c3", 3), (tmp_path / "a2", 1), (tmp_path / "r1", 1)):
        assert load_and_check(path, ALL_DP, 0, 1, seed) == []
    # The RNG state of each saving rank is kept (one file per rank).
    assert {f for f in manifest.files if f.startswith("rank_")} == {"rank_0.json", "rank_1.json"}


def _die_mid_save(rank: int, world: int, root: str) -> None:
    model = ShardedTables(A, rank, world, seed=1)
    save(Path(root) / "good", model, model.fused_optimizer, step=1)
    model = ShardedTables(A, rank, world, seed=2)
    if rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        real = fs._write_item

        def write_then_die(*args: object, **kwargs: object) -> object:
            real(*args, **kwargs)  # type: ignore[arg-type]
            os._exit(3)  # killed after writing part of its shard file

        fs._write_item = write_then_die  # type: ignore[assignment]
    save(
        Path(root) / "new",
        model,
        model.fused_optimizer,
        step=2,
        timeout=datetime.timedelta(seconds=10),
    )


def test_rank_killed_mid_save_leaves_previous_checkpoint_and_no_new_one(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match="exit code 3"):
        run_on_ranks(_die_mid_save, 2, str(tmp_path), timeout_s=60, grace_s=3)
    assert not (tmp_path / "new").exists()
    assert (tmp_path / ".new.partial").is_dir()  # the debris is only under the partial name
    assert read_manifest(tmp_path / "good").step == 1
    assert load_and_check(tmp_path / "good", ALL_DP, 0, 1, 1) == []
