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


def _nan_step(rank: int, world_size: int, out: str, pipelined: bool) -> dict[str, Any]:
    """Two good steps, then one whose sample 0 on rank 0 has a NaN dense value; through the
    plain step or the pipeline (`training.pipeline`)."""
    config = dlrm_config.load_config(
        None,
        [
            f"training.output_dir={out}/rank{rank}",
            "checkpoint.every=0",
            "data.batch_size=64",
            "training.plot=false",
            "training.timeout_s=60",
            "warmup.stages=[]",
            f"training.pipeline={str(pipelined).lower()}",
        ],
    )
    env = dlrm_train.RunEnv(rank=rank, world_size=world_size)
    model = dlrm_train.shard_model(dlrm_train.build_model(config, env.device), config, env)
    trainer = dlrm_train.Trainer(config, env, model)

    def poisoned() -> Any:  # the third batch has a NaN dense value on rank 0
        for i, batch in enumerate(trainer.train_source if pipelined else trainer.train_data):
            if i == 2 and rank == 0:
                batch.dense[0, 0] = float("nan")
            yield batch

    batches = poisoned()

    def step() -> None:
        if not pipelined:
            trainer.train_step(next(batches))
            return
        assert trainer.pipeline is not None
        loss, logits, labels = trainer.pipeline.progress(batches)
        trainer.step_done(loss, logits, labels, True)  # as the script's loop does

    try:
        for _ in range(2):
            step()
        before = _state(trainer)
        step()
        after = _state(trainer)
        skipped = trainer.nonfinite.total
        step()  # training goes on
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


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_a_nan_dense_input_changes_no_table_state_or_dense_weight(
    tmp_path: pathlib.Path, pipelined: bool
) -> None:
    _check(_nan_step(0, 1, str(tmp_path), pipelined))


@pytest.mark.multiprocess
@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_two_ranks_skip_the_step_together(tmp_path: pathlib.Path, pipelined: bool) -> None:
    for result in run_on_ranks(_nan_step, 2, str(tmp_path), pipelined, timeout_s=240):
        _check(result)
