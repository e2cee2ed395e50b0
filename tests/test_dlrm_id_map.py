"""The DLRM script with id-mapped tables (issue 26): one line of config, the drifting synthetic
data, Criteo raw ids, the maps' stats in the log and progress line, resume, and two ranks
(pipelined; only fault tolerance sends sharded maps to the plain loop)."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import sys
from typing import Any

import pytest
import torch
from test_dlrm import _criteo_args, dlrm_config, dlrm_train, records

from recopt.modules import IdMapConfig
from recopt.progress import format_id_map_stats
from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "dlrm_id_map.toml")
BIG_ROWS = 100_000  # table t0 never fills in these runs: its map's counts are exact sets


def settings(out: pathlib.Path | str, steps: int, *extra: str) -> list[str]:
    return [
        f"training.output_dir={out}",
        f"training.steps={steps}",
        "training.log_every=20",
        "training.eval_every=0",
        "training.plot=false",
        "training.timeout_s=120",
        "checkpoint.every=20",
        "data.batch_size=128",
        "data.val_batches=2",
        f"embedding.tables.0.num_embeddings={BIG_ROWS}",
        *[f"embedding.tables.{i}.num_embeddings=200" for i in (1, 2, 3)],
        *extra,
    ]


def argv(out: pathlib.Path, steps: int, *extra: str) -> list[str]:
    args = ["--config", CONFIG]
    for item in settings(out, steps, *extra):
        args += ["--set", item]
    return args


def distinct_ids(config: dlrm_config.TrainingConfig, feature: str, global_batches: int) -> int:
    """Distinct raw ids of ``feature`` in the first global batches of the training stream,
    drawn by the data source itself (the reference for the map's counts)."""
    import dlrm_data

    log: Any = dlrm_data.synthetic_source(config, 0, 1, "train")
    ids = torch.cat([log.generate(g)[1][feature].values() for g in range(global_batches)])
    return int(ids.unique().numel())


def check_learned_with_stats(out: pathlib.Path, config: Any, global_batches: int) -> None:
    """Loss finite and falling, and each window's map stats logged, t0's against the data."""
    train = [r for r in records(out) if r["split"] == "train"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert train[-1]["loss"] < train[0]["loss"] - 0.02
    first = train[0]
    seen = distinct_ids(config, "cat_0", global_batches)
    assert first["id_map.t0.new_ids"] * 20 == pytest.approx(seen)  # every id its own row
    assert first["id_map.t0.occupancy"] == pytest.approx(seen / BIG_ROWS)
    assert first["id_map.t0.evictions"] == 0
    for record in train[1:]:  # the small tables are full and evict every step
        assert record["id_map.t1.occupancy"] == 1.0 and record["id_map.t1.evictions"] > 0


def test_one_line_of_config_makes_every_table_id_mapped() -> None:
    config = dlrm_config.load_config(CONFIG)
    assert all(t.id_map == IdMapConfig(policy="lru") for t in config.embedding.tables)
    assert config.data.synthetic.id_space == "drifting"
    own = dlrm_config.load_config(
        None, ["embedding.id_map={policy='lfu'}", "embedding.tables.2.id_map={policy='lru'}"]
    )
    policies = [t.id_map.policy if t.id_map else None for t in own.embedding.tables]
    assert policies == ["lfu", "lfu", "lru", "lfu", "lfu", "lfu", "lfu", "lfu"]
    assert all(t.id_map is None for t in dlrm_config.load_config(None).embedding.tables)
    with pytest.raises(ValueError, match=r"id_map.policy 'mru' is not a policy"):
        dlrm_config.load_config(None, ["embedding.id_map={policy='mru'}"])


def test_one_rank_learns_the_drifting_ids_and_logs_the_maps_stats(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    validation = sys.modules["dlrm_validate"]  # imported by the training script
    built = validation.build_data
    validation_logs: list[Any] = []

    def build_and_keep(*args: Any, **kwargs: Any) -> Any:
        data = built(*args, **kwargs)
        if args[2] == "val":
            validation_logs.append(data)
        return data

    monkeypatch.setattr(validation, "build_data", build_and_keep)
    # The pipeline (on one rank: no sharding, the remap in the step's own forward) is allowed.
    assert dlrm_train.main(argv(tmp_path, 60, "training.pipeline=true")) == 0
    # Validation after 60 steps sees the popular ids of global batch 60, not of batch 0.
    assert [log.drift_clock for log in validation_logs] == [60]
    config = dlrm_config.load_config(CONFIG, settings(tmp_path, 60))
    check_learned_with_stats(tmp_path, config, global_batches=20)
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("step 60/60")]
    assert progress and "| ids 4 tables occ " in progress[0] and "evict " in progress[0]
    assert "plain loop" not in err
    assert [r["step"] for r in records(tmp_path) if r["split"] == "val"] == [60]
    if importlib.util.find_spec("tensorboard") is not None:  # the recopt[tensorboard] extra
        from test_dlrm_usability import _scalars

        scalars = _scalars(tmp_path / "tensorboard")
        train = [r for r in records(tmp_path) if r["split"] == "train"]
        for tag in ("id_map.t0.new_ids", "id_map.t1.occupancy", "id_map.t1.evictions"):
            logged = [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in train]
            assert scalars[f"train/{tag}"] == logged


def test_one_rank_resume_with_id_maps_equals_an_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    whole = dlrm_config.load_config(CONFIG, settings(tmp_path / "whole", 60))
    expected = dlrm_train.train(whole, dlrm_train.RunEnv())
    first = dlrm_config.load_config(CONFIG, settings(tmp_path / "parts", 40))
    dlrm_train.train(first, dlrm_train.RunEnv())
    again = dlrm_config.load_config(CONFIG, settings(tmp_path / "parts", 60))
    assert dlrm_train.train(again, dlrm_train.RunEnv(), resume=True) == expected
    last = [records(tmp_path / p)[-2] for p in ("whole", "parts")]  # the last train record
    stats = [{k: v for k, v in r.items() if k.startswith("id_map.")} for r in last]
    assert stats[0] and stats[0] == stats[1]  # the maps resumed too


def test_one_rank_pipelined_run_with_id_maps_equals_the_plain_loop(tmp_path: pathlib.Path) -> None:
    # On one rank the pipeline remaps batch i+1 on its worker thread while batch i trains
    # (here over two threads: the maps split between them, the same steps).
    for loop in ("true", "false"):
        extra = (f"training.pipeline={loop}", "training.remap_threads=2")
        assert dlrm_train.main(argv(tmp_path / loop, 40, *extra)) == 0

    def comparable(out: pathlib.Path) -> list[dict[str, float]]:
        skip = ("time_s", "samples_per_s", "pipeline_")
        return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in records(out)]

    pipelined = comparable(tmp_path / "true")
    assert pipelined == comparable(tmp_path / "false")  # losses, AUCs, map stats: identical
    train = [r for r in records(tmp_path / "true") if r["split"] == "train"]
    assert all(r["pipeline_remap_worker_ms"] > 0 for r in train)  # the worker's time logged
    assert any("id_map.t1.evictions" in r for r in pipelined)


def _two_ranks(rank: int, world_size: int, out: str) -> tuple[str, dict[str, float], bool]:
    """A whole run and a run resumed halfway, pipeline on: (rank 0's stderr, the resumed
    run's validation, whether it equals the whole run's)."""
    sys.stderr = io.StringIO()  # rank 0's progress bar and notices
    env = dlrm_train.RunEnv(rank=rank, world_size=world_size)
    pipeline = "training.pipeline=true"
    whole = dlrm_config.load_config(CONFIG, settings(f"{out}/whole", 40, pipeline))
    expected = dlrm_train.train(whole, env)
    first = dlrm_config.load_config(CONFIG, settings(f"{out}/parts", 20, pipeline))
    dlrm_train.train(first, env)
    again = dlrm_config.load_config(CONFIG, settings(f"{out}/parts", 40, pipeline))
    resumed = dlrm_train.train(again, env, resume=True)
    return sys.stderr.getvalue(), resumed, resumed == expected


@pytest.mark.multiprocess
def test_two_ranks_pipelined_learn_log_stats_and_resume(tmp_path: pathlib.Path) -> None:
    results = run_on_ranks(_two_ranks, 2, str(tmp_path), timeout_s=280)
    (err, resumed, equal), (_, resumed_1, equal_1) = results
    assert equal and equal_1 and resumed == resumed_1  # resume equals the uninterrupted run
    assert "plain loop" not in err and "resumed from step 20" in err
    assert "pipeline_input_dist_ms" in records(tmp_path / "whole")[-2]  # the pipeline ran
    config = dlrm_config.load_config(CONFIG, settings(tmp_path / "whole", 40))
    # The maps see the global batch: 2 ranks x 20 steps of the first window.
    check_learned_with_stats(tmp_path / "whole", config, global_batches=40)


def test_criteo_categoricals_reach_id_mapped_tables_raw(tmp_path: pathlib.Path) -> None:
    one_per_step = ("--set", "training.log_every=1", "--set", "embedding.id_map={policy='lru'}")
    assert dlrm_train.main(_criteo_args(tmp_path, 20, 2, *one_per_step)) == 0
    train = [r for r in records(tmp_path / "out") if r["split"] == "train"]
    # 8 lines a batch, every categorical value distinct (test_data.criteo_line): raw ids give
    # each its own row in all 26 tables of 100 rows; hashed into 99 rows some would share.
    assert [r["id_map.t0.new_ids"] for r in train] == [8.0, 8.0]
    assert all(train[-1][f"id_map.t{c}.occupancy"] == 0.16 for c in range(26))


def test_the_progress_line_short_form_of_the_stats() -> None:
    stats = {
        "a": {"occupancy": 0.62, "new_ids": 30.0, "evictions": 10.0, "admissions": 0.0},
        "b": {"occupancy": 1.0, "new_ids": 11.4, "evictions": 20.0, "admissions": 0.0},
    }
    assert format_id_map_stats(stats) == "ids 2 tables occ 62-100% new 41/step evict 30/step"
    stats["b"]["admissions"] = 3.0
    assert format_id_map_stats({"b": stats["b"]}) == (
        "ids 1 table occ 100% new 11/step evict 20/step admit 3/step"
    )
    assert format_id_map_stats({}) == ""
