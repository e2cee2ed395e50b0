"""One seed, the same initial weights, whatever backend the fused kernels run.

Building a kernel may draw random numbers (fbgemm initialises its own weights; AUTO's probes
make random tables unless its choice is cached), so the modules build their kernels with the
random streams put back afterwards (`rng_unchanged`) and draw the weights themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.config import Backend
from recopt.kernels.factory import rng_unchanged
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=4, feature_names=(f"f{i}",))
    for i in range(2)
]


def _config(backend: Backend) -> FusedOptimizerConfig:
    return FusedOptimizerConfig(name="adagrad", lr=0.1, backend=backend)


def test_rng_unchanged_puts_the_stream_back() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with rng_unchanged(torch.device("cpu")):
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(("device", "want"), [("cuda", [2]), ("cuda:1", [1]), ("cpu", [])])
def test_rng_unchanged_forks_the_gpu_the_device_means(
    device: str, want: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank on GPU 2 (torch.cuda.set_device(2)) builds on a bare "cuda": that GPU's stream
    # is the one to put back, not GPU 0's. No GPU here: the fork is recorded, not run.
    forked: list[list[int]] = []

    @contextlib.contextmanager
    def fork_rng(devices: list[int], device_type: str) -> Iterator[None]:
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    with rng_unchanged(torch.device(device)):
        pass
    assert forked == [want]


def test_fused_collection_weights_do_not_depend_on_the_backend() -> None:
    weights = []
    for backend in (Backend.RECOPT, Backend.FBGEMM):
        torch.manual_seed(1)
        ebc = FusedEmbeddingBagCollection(TABLES, optimizer=_config(backend))
        weights.append({k: v.clone() for k, v in ebc.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def _local_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of every table's weights (ShardedTensors), copied."""
    return {
        key: torch.cat([shard.tensor.detach().flatten() for shard in value.local_shards()])
        for key, value in module.state_dict().items()
        if key.endswith("weight") and value.local_shards()
    }


def _sharded_weights(rank: int, world: int, kind: str, backend: Backend) -> dict[str, Any]:
    from recopt.sharding import (
        ShardedEmbeddingBagCollection,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    requests = {
        t.name: row_wise() if kind == "row_wise" else table_wise(i % world)
        for i, t in enumerate(TABLES)
    }
    plan = construct_module_sharding_plan(TABLES, requests, world)
    torch.manual_seed(1)
    module = ShardedEmbeddingBagCollection(TABLES, plan, optimizer=_config(backend))
    before = _local_weights(module)
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 3, (2 * 3,), generator=generator)
    ids = torch.randint(0, 40, (int(lengths.sum()),), generator=generator)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=lengths)
    module(kjt).values().square().sum().backward()
    after = _local_weights(module)
    return {"before": before, "after": after}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
def test_sharded_collection_weights_do_not_depend_on_the_backend(kind: str) -> None:
    results = [
        run_on_ranks(_sharded_weights, 2, kind, backend, timeout_s=120)
        for backend in (Backend.RECOPT, Backend.FBGEMM)
    ]
    for rank in range(2):
        recopt, fbgemm = results[0][rank], results[1][rank]
        for key, value in recopt["before"].items():
            assert torch.equal(value, fbgemm["before"][key]), (rank, key)
            # One Adagrad step on either backend: the same to float32 rounding.
            torch.testing.assert_close(recopt["after"][key], fbgemm["after"][key])
