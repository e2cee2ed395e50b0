"""NaN or infinite per-id weights are rejected like bad ids: named, and nothing is updated."""

from __future__ import annotations

import pytest
import torch
from fused_snapshots import assert_bit_identical, snapshot

from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.config import Backend
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    NonFiniteWeightError,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4, feature_names=("f1",)),
]
BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def _features(bad: float | None = None) -> KeyedJaggedTensor:
    weights = torch.tensor([0.5, 2.0, 1.0, -1.5, 0.25, 3.0])
    if bad is not None:
        weights[4] = bad  # feature f1's second weight
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.tensor([1, 2, 3, 0, 5, 5]), torch.tensor([2, 1, 1, 2]), weights=weights
    )


def _step(ebc: torch.nn.Module, features: KeyedJaggedTensor) -> None:
    out = ebc(features).values()
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize(
    ("backend", "name"),
    [(Backend.RECOPT, "sgd"), (Backend.RECOPT, "adam"), (Backend.FBGEMM, "sgd")],
)
def test_fused_rejects_non_finite_weight_and_updates_nothing(
    backend: Backend, name: str, bad: float
) -> None:
    torch.manual_seed(0)
    try:
        ebc = FusedEmbeddingBagCollection(
            TABLES,
            optimizer=FusedOptimizerConfig(name=name, lr=0.1, backend=backend),
            is_weighted=True,
        )
    except ValueError as err:  # fbgemm not usable here
        pytest.skip(str(err))
    _step(ebc, _features())  # a good step first: state is non-trivial
    before = snapshot(ebc)
    with pytest.raises(NonFiniteWeightError, match=r"table 't1', feature 'f1'.*NaN or infinite"):
        _step(ebc, _features(bad))
    assert_bit_identical(snapshot(ebc), before)
    # The collection still trains, exactly as one that never saw the bad batch.
    torch.manual_seed(0)
    reference = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name=name, lr=0.1, backend=backend), is_weighted=True
    )
    _step(reference, _features())
    _step(reference, _features())
    _step(ebc, _features())
    assert_bit_identical(snapshot(ebc), snapshot(reference))


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_plain_collection_rejects_non_finite_weight(bad: float) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    with pytest.raises(NonFiniteWeightError, match=r"table 't1', feature 'f1'"):
        ebc(_features(bad))
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_float64_weight_overflowing_float32_is_rejected() -> None:
    # Finite as float64, infinite once converted to the tables' float32.
    features = _features()
    weights = features.weights().double()
    weights[0] = 1e300
    big = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], features.values(), features.lengths(), weights=weights
    )
    ebc = FusedEmbeddingBagCollection(TABLES, is_weighted=True)
    with pytest.raises(NonFiniteWeightError, match=r"table 't0', feature 'f0'"):
        ebc(big)


def _sharded_rejects_non_finite_weight(rank: int, world: int) -> None:
    from recopt.sharding.input_dist import RemoteInputError
    from recopt.sharding.model_parallel import DistributedModelParallel
    from recopt.sharding.state import full_tensor

    def full_state() -> dict[str, torch.Tensor]:
        state = {k: full_tensor(v).clone() for k, v in dmp.state_dict().items()}
        for key, value in dmp.fused_optimizer.state_dict()["state"].items():
            for name, tensor in value.items():
                state[f"opt.{key}.{name}"] = full_tensor(tensor).clone()
        return state

    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="adam", lr=0.1), is_weighted=True
    )
    dmp = DistributedModelParallel(ebc)
    _step(dmp, _features())
    before = full_state()
    if rank == world - 1:
        with pytest.raises(NonFiniteWeightError, match=r"table 't1', feature 'f1'"):
            dmp(_features(float("nan")))
    else:
        with pytest.raises(RemoteInputError, match=rf"rank\(s\) \[{world - 1}\]"):
            dmp(_features())
    after = full_state()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    _step(dmp, _features())  # every rank trains on


def test_sharded_rejects_non_finite_weight_on_one_rank_and_updates_nothing() -> None:
    run_on_ranks(_sharded_rejects_non_finite_weight, 2, timeout_s=240)
