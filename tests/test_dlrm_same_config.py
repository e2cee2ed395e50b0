"""Ranks of one DLRM run with different configs fail at start, every one of them, naming the
differing keys (issue 29, item 5); equal configs pass."""

from __future__ import annotations

import pathlib
import sys

import pytest

from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_agree  # noqa: E402
import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402


def _train(rank: int, world_size: int, out: str, per_rank: list[list[str]]) -> str:
    """Runs the script's ``train`` with this rank's overrides; returns its error, or ""."""
    overrides = [
        f"training.output_dir={out}",
        "training.steps=2",
        "training.plot=false",
        "training.timeout_s=60",
        "data.batch_size=32",
        "data.val_batches=1",
        *per_rank[rank],
    ]
    config = dlrm_config.load_config(None, overrides)
    try:
        dlrm_train.train(config, dlrm_train.RunEnv(rank=rank, world_size=world_size))
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.multiprocess
def test_differing_configs_fail_on_every_rank_naming_the_keys(tmp_path: pathlib.Path) -> None:
    per_rank = [
        ["embedding.optimizer.lr=0.05"],
        ["embedding.optimizer.lr=0.5", "dense_optimizer.name=adam"],
    ]
    errors = run_on_ranks(_train, 2, str(tmp_path / "run"), per_rank, timeout_s=180)
    for error in errors:
        assert "the ranks run different configs; 2 key(s) differ" in error
        assert 'dense_optimizer.name: rank 0 = "adagrad", rank 1 = "adam"' in error
        assert "embedding.optimizer.lr: rank 0 = 0.05, rank 1 = 0.5" in error
        assert "same --config file and --set overrides" in error
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained or saved
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.multiprocess
def test_equal_configs_train(tmp_path: pathlib.Path) -> None:
    same = ["embedding.optimizer.lr=0.1"]
    assert run_on_ranks(_train, 2, str(tmp_path / "run"), [same, same], timeout_s=180) == ["", ""]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_digest_covers_every_key_of_every_table() -> None:
    base = dlrm_config.load_config(None, [])
    flat = dlrm_agree.flat_config(base)
    assert flat["embedding.tables.3.num_embeddings"] == "2000"
    assert flat["warmup.stages.0.max_iters"] == "100"
    other = dlrm_config.load_config(None, ["embedding.tables.3.num_embeddings=2001"])
    assert dlrm_agree.config_digest(dlrm_agree.flat_config(other)) != dlrm_agree.config_digest(flat)
    assert dlrm_agree.config_digest(flat) == dlrm_agree.config_digest(dict(reversed(flat.items())))
