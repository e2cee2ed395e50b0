"""Ids of a non-integer dtype (bool, float) are refused by the input check, naming table and
feature, before anything is looked up or updated: plain, fused and sharded collections."""

from __future__ import annotations

import pytest
import torch
from fused_snapshots import assert_bit_identical, snapshot

from recopt.kernels import FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    InvalidIdError,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4, feature_names=("f1",)),
]
BAD_DTYPES = [torch.bool, torch.float32, torch.float64]
MESSAGE = r"table 't0', feature 'f0': ids are of dtype torch\.\w+, not integers"


def _features(dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    ids = torch.tensor([1, 0, 1, 1, 0, 1]).to(dtype)  # valid rows as ints, so bools pass bounds
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, torch.tensor([2, 1, 1, 2]))


def _step(ebc: torch.nn.Module, features: KeyedJaggedTensor) -> None:
    out = ebc(features).values()
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_fused_adam_refuses_non_integer_ids_and_changes_nothing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig(name="adam", lr=0.1))
    _step(ebc, _features())  # a good step first: Adam's step counters are at 1
    before = snapshot(ebc)
    with pytest.raises(InvalidIdError, match=MESSAGE):
        _step(ebc, _features(dtype))
    assert_bit_identical(snapshot(ebc), before)
    # It trains on exactly as one that never saw the bad batch.
    torch.manual_seed(0)
    reference = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="adam", lr=0.1)
    )
    _step(reference, _features())
    _step(reference, _features())
    _step(ebc, _features())
    assert_bit_identical(snapshot(ebc), snapshot(reference))


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_plain_collection_refuses_non_integer_ids(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    optimizer = torch.optim.Adam(ebc.parameters(), lr=0.1)
    _step(ebc, _features())
    optimizer.step()
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    steps = [float(s["step"]) for s in optimizer.state.values()]
    with pytest.raises(InvalidIdError, match=MESSAGE):
        _step(ebc, _features(dtype))
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert [float(s["step"]) for s in optimizer.state.values()] == steps


@pytest.mark.parametrize("fused", [False, True])
def test_unpooled_collections_refuse_bool_ids(fused: bool) -> None:
    tables = [EmbeddingConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=("f0",))]
    optimizer = FusedOptimizerConfig(name="adam", lr=0.1)
    ec = (
        FusedEmbeddingCollection(tables, optimizer=optimizer)
        if fused
        else EmbeddingCollection(tables)
    )
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    ids = KeyedJaggedTensor.from_lengths_sync(
        ["f0"], torch.tensor([True, False]), torch.tensor([1, 1])
    )
    with pytest.raises(InvalidIdError, match=MESSAGE.replace(r"torch\.\w+", "torch.bool")):
        ec(ids)
    for key, value in ec.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_integer_ids_of_other_widths_still_pass() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    want = ebc(_features()).values()
    assert torch.equal(ebc(_features(torch.int32)).values(), want)


def _sharded_refuses_bool_ids_on_one_rank(rank: int, world: int) -> None:
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
    ebc = FusedEmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig(name="adam", lr=0.1))
    dmp = DistributedModelParallel(ebc)
    _step(dmp, _features())
    before = full_state()
    if rank == world - 1:
        with pytest.raises(InvalidIdError, match=MESSAGE.replace(r"torch\.\w+", "torch.bool")):
            _step(dmp, _features(torch.bool))
    else:
        with pytest.raises(RemoteInputError, match=rf"rank\(s\) \[{world - 1}\]"):
            _step(dmp, _features())
    after = full_state()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    _step(dmp, _features())  # every rank trains on


@pytest.mark.multiprocess
def test_sharded_refuses_bool_ids_on_one_rank_and_changes_nothing() -> None:
    run_on_ranks(_sharded_refuses_bool_ids_on_one_rank, 2, timeout_s=240)
