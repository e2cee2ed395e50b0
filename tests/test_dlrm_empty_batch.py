"""The DLRM model on an empty batch (B = 0): one rank alone, and one of two sharded ranks.

The last, short batch of a data split can be empty on a rank. The model used to crash in the
dot interaction's reshape (``view(0, -1, D)``) and in oneDNN's backward product; the sharded
collection's own empty-batch path (tests/test_sharding_empty_batch.py) never reached the model.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch

from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_build  # noqa: E402
import dlrm_config  # noqa: E402


def _config(interaction: str) -> dlrm_config.TrainingConfig:
    return dlrm_config.load_config(
        None, [f"model.interaction={interaction}", "data.batch_size=8", "training.timeout_s=60"]
    )


def _batch(config: dlrm_config.TrainingConfig, size: int, seed: int) -> tuple[Any, Any]:
    """``size`` samples: dense [size, 13] and one id per bag (a fixed draw)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f for t in config.embedding.tables for f in t.feature_names]
    rows = [t.num_embeddings for t in config.embedding.tables for _ in t.feature_names]
    values = torch.cat([torch.randint(0, n, (size,), generator=gen) for n in rows])
    lengths = torch.ones(len(keys) * size, dtype=torch.int64)
    dense = torch.rand(size, 13, generator=gen)
    return dense, KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_one_rank_empty_batch_gives_no_logits_and_changes_nothing(interaction: str) -> None:
    config = _config(interaction)
    model = dlrm_build.build_model(config, torch.device("cpu"))
    before = _weights(model)
    dense, sparse = _batch(config, 0, seed=0)
    logits = model(dense, sparse)
    assert logits.shape == (0,)
    logits.sum().backward()  # the fused tables step on no rows
    for key, value in _weights(model).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert not param.grad.any(), name


def _two_ranks(rank: int, world_size: int, interaction: str) -> dict[str, torch.Tensor]:
    """Rank 0's batch is empty, rank 1's has 4 samples; rank 1 returns its logits."""
    config = _config(interaction)
    env = dlrm_build.RunEnv(rank=rank, world_size=world_size)
    model = dlrm_build.shard_model(dlrm_build.build_model(config, torch.device("cpu")), config, env)
    dense, sparse = _batch(config, 0 if rank == 0 else 4, seed=1)
    logits = model(dense, sparse)
    logits.sum().backward()
    return {"logits": logits.detach()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_two_ranks_one_with_an_empty_batch_match_the_unsharded_model(interaction: str) -> None:
    results = run_on_ranks(_two_ranks, 2, interaction, timeout_s=180)
    assert results[0]["logits"].shape == (0,)
    config = _config(interaction)
    reference = dlrm_build.build_model(config, torch.device("cpu"))  # the same seeded weights
    with torch.no_grad():
        expected = reference(*_batch(config, 4, seed=1))
    torch.testing.assert_close(results[1]["logits"], expected, rtol=1e-5, atol=1e-6)
