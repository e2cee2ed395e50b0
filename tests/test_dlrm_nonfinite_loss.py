"""A NaN in the dense input of one sample stops the whole step (issue 29, item 3).

ReLU's backward can turn the NaN gradient of that sample into 0 before it reaches the
pooled embeddings, so the fused tables' gate used to see finite row gradients and update
every table while the dense step was skipped. Now a non-finite loss makes the gradients of
the step non-finite everywhere: no table, optimizer state or dense weight changes, on every
rank, and the step is counted as skipped.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch

from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a (nested) state dict, by path; a sharded one as its local shards."""
    if isinstance(obj, dict):
        out: dict[str, torch.Tensor] = {}
        for key, value in obj.items():
            out.update(_tensors(value, f"{prefix}/{key}"))
        return out
    if isinstance(obj, list | tuple):
        found: dict[str, torch.Tensor] = {}
        for i, item in enumerate(obj):
            found.update(_tensors(item, f"{prefix}/{i}"))
        return found
    if hasattr(obj, "local_shards"):
        shards = [s.tensor.detach().flatten() for s in obj.local_shards()]
        return {prefix: torch.cat(shards).clone()} if shards else {}
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    return {}


def _state(trainer: dlrm_train.Trainer) -> dict[str, torch.Tensor]:
    return {
        **_tensors(trainer.model.state_dict(), "model"),
        **_tensors(trainer.base_optimizer.state_dict(), "optim"),
    }


def _nan_step(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Two good steps, then one whose sample 0 on rank 0 has a NaN dense value."""
    config = dlrm_config.load_config(
        None,
        [
            f"training.output_dir={out}/rank{rank}",
            "checkpoint.every=0",
            "data.batch_size=64",
            "training.plot=false",
            "training.timeout_s=60",
            "warmup.stages=[]",
        ],
    )
    env = dlrm_train.RunEnv(rank=rank, world_size=world_size)
    model = dlrm_train.shard_model(dlrm_train.build_model(config, env.device), config, env)
    trainer = dlrm_train.Trainer(config, env, model)
    try:
        batches = iter(trainer.train_data)
        for _ in range(2):
            trainer.train_step(next(batches))
        before = _state(trainer)
        batch = next(batches)
        if rank == 0:
            batch.dense[0, 0] = float("nan")
        trainer.train_step(batch)
        after = _state(trainer)
        skipped = trainer.nonfinite.total
        trainer.train_step(next(batches))  # training goes on
        moved = _state(trainer)
    finally:
        trainer.checkpoints.close()
    return {"before": before, "after": after, "skipped": skipped, "moved": moved}


def _check(result: dict[str, Any]) -> None:
    assert result["skipped"] == 1
    before, after, moved = result["before"], result["after"], result["moved"]
    assert before.keys() == after.keys()
    tables = [k for k in before if "embedding_bags" in k and k.startswith("model")]
    assert tables
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
    assert any(not torch.equal(moved[k], before[k]) for k in tables)  # the next step updates


def test_a_nan_dense_input_changes_no_table_state_or_dense_weight(tmp_path: pathlib.Path) -> None:
    _check(_nan_step(0, 1, str(tmp_path)))


@pytest.mark.multiprocess
def test_two_ranks_skip_the_step_together(tmp_path: pathlib.Path) -> None:
    for result in run_on_ranks(_nan_step, 2, str(tmp_path), timeout_s=240):
        _check(result)
