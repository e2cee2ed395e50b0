"""Variable batch per feature through EmbeddingBagCollection and FusedEmbeddingBagCollection.

The reference is plain torch per feature: each feature's distinct bags pooled with
``embedding_bag``, then picked for every sample with the KJT's ``inverse_indices``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    FusedOptimizerConfig,
    PoolingType,
)
from recopt.sparse import KeyedJaggedTensor

# Distinct bags per feature (a: 3, b: 1, c: 2) for a batch of 4 samples.
BAGS = {"a": [[1, 2], [], [3]], "b": [[4, 5, 6]], "c": [[7], [0, 8]]}
INVERSE = {"a": [2, 0, 0, 1], "b": [0, 0, 0, 0], "c": [1, 0, 1, 1]}
DIMS = {"t0": 4, "t1": 8}


def _tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t0", num_embeddings=10, embedding_dim=4, feature_names=["a", "c"], pooling=pooling
        ),
        EmbeddingBagConfig(name="t1", num_embeddings=9, embedding_dim=8, feature_names=["b"]),
    ]


def _weights_of(ids: list[int]) -> list[float]:
    return [0.5 + 0.25 * (i % 3) for i in ids]


def _vbe_kjt(weighted: bool = False, keys: tuple[str, ...] = ("b", "a", "c")) -> KeyedJaggedTensor:
    """The bags above, keys in an order the collections must reorder."""
    ids = [i for k in keys for bag in BAGS[k] for i in bag]
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.tensor(ids),
        lengths=torch.tensor([len(bag) for k in keys for bag in BAGS[k]]),
        weights=torch.tensor(_weights_of(ids)) if weighted else None,
        stride_per_key_per_rank=[[len(BAGS[k])] for k in keys],
        inverse_indices=(list(keys), torch.tensor([INVERSE[k] for k in keys])),
    )


def _expanded_kjt(weighted: bool = False) -> KeyedJaggedTensor:
    """The same batch with one bag per sample (what inverse_indices expand to)."""
    bags = {k: [BAGS[k][i] for i in INVERSE[k]] for k in BAGS}
    ids = [i for k in bags for bag in bags[k] for i in bag]
    return KeyedJaggedTensor(
        keys=list(bags),
        values=torch.tensor(ids),
        lengths=torch.tensor([len(bag) for k in bags for bag in bags[k]]),
        weights=torch.tensor(_weights_of(ids)) if weighted else None,
    )


def _reference(
    weights: dict[str, torch.Tensor], weighted: bool, pooling: PoolingType
) -> torch.Tensor:
    """Per-feature torch: pool each distinct bag, then take every sample's bag."""
    columns = []
    for feature, table in (("a", "t0"), ("c", "t0"), ("b", "t1")):
        ids = [i for bag in BAGS[feature] for i in bag]
        offsets = [0]
        for bag in BAGS[feature]:
            offsets.append(offsets[-1] + len(bag))
        mode = pooling.value if table == "t0" else "sum"
        pooled = nn.functional.embedding_bag(
            torch.tensor(ids, dtype=torch.int64),
            weights[table],
            torch.tensor(offsets),
            mode="sum",
            per_sample_weights=torch.tensor(_weights_of(ids)) if weighted else None,
            include_last_offset=True,
        )
        if mode == "mean":
            counts = torch.tensor([max(len(bag), 1) for bag in BAGS[feature]])
            pooled = pooled / counts.unsqueeze(1)
        columns.append(pooled[torch.tensor(INVERSE[feature])])
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_forward_and_backward_match_torch_per_feature(
    pooling: PoolingType, weighted: bool
) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(pooling), is_weighted=weighted)
    out = ebc(_vbe_kjt(weighted))
    assert out.keys() == ["a", "c", "b"] and out.values().shape == (4, 16)
    ref_weights = {
        name: bag.weight.detach().clone().requires_grad_()
        for name, bag in ebc.embedding_bags.items()
    }
    expected = _reference(ref_weights, weighted, pooling)
    torch.testing.assert_close(out.values(), expected)
    grad = torch.randn(4, 16)
    out.values().backward(grad)
    expected.backward(grad)
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(bag.weight.grad, ref_weights[name].grad)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "row_wise_adam"])
def test_fused_steps_match_the_expanded_batch(optimizer: str) -> None:
    """Training on the variable batch equals training on its expansion: per-table optimizers
    (two kernels), weighted, three steps."""
    config = FusedOptimizerConfig(name=optimizer, lr=0.1, eps=1e-3)
    other = FusedOptimizerConfig(name="adagrad", lr=0.05, eps=1e-3)

    def build() -> FusedEmbeddingBagCollection:
        torch.manual_seed(0)
        return FusedEmbeddingBagCollection(
            _tables(), optimizer=config, table_optimizers={"t1": other}, is_weighted=True
        )

    vbe, expanded = build(), build()
    grad = torch.linspace(-1, 1, 64).view(4, 16)
    for _ in range(3):
        out = vbe(_vbe_kjt(weighted=True))
        ref = expanded(_expanded_kjt(weighted=True))
        torch.testing.assert_close(out.values(), ref.values())
        out.values().backward(grad)
        ref.values().backward(grad)
    for key, value in expanded.state_dict().items():
        torch.testing.assert_close(vbe.state_dict()[key], value)
    ref_state = expanded.fused_optimizer.state_dict()["state"]
    for param, states in vbe.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            torch.testing.assert_close(value, ref_state[param][name])


def test_fused_sgd_step_matches_torch_per_feature() -> None:
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(
        _tables(), optimizer=FusedOptimizerConfig(name="sgd", lr=0.5)
    )
    ref_weights = {
        name: holder.weight.detach().clone().requires_grad_()
        for name, holder in fused.embedding_bags.items()
    }
    grad = torch.linspace(-1, 1, 64).view(4, 16)
    fused(_vbe_kjt()).values().backward(grad)
    _reference(ref_weights, False, PoolingType.SUM).backward(grad)
    for name, holder in fused.embedding_bags.items():
        expected = ref_weights[name] - 0.5 * ref_weights[name].grad
        torch.testing.assert_close(holder.weight, expected.detach())


def test_variable_batch_over_several_ranks_and_a_shared_feature() -> None:
    """stride_per_key_per_rank with several columns; a feature read by two tables."""
    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=2, feature_names=["a"]),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables)
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 1, 2, 0, 0]),
        stride_per_key_per_rank=[[1, 2], [1, 1]],
        inverse_indices=(["a", "b"], torch.tensor([[2, 1, 0], [0, 1, 1]])),
    )
    out = ebc(kjt)
    assert out.keys() == ["a@t0", "a@t1"]
    w0, w1 = ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(out["a@t0"], torch.stack([w0[3] + w0[4], w0[2], w0[1]]))
    torch.testing.assert_close(out["a@t1"], torch.stack([w1[3] + w1[4], w1[2], w1[1]]))


def test_inverse_indices_expand_a_regular_batch() -> None:
    """As TorchRec: given inverse_indices, a regular batch's rows are expanded too."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables()[1:])
    kjt = KeyedJaggedTensor(
        keys=["b"],
        values=torch.tensor([1, 2]),
        lengths=torch.tensor([1, 1]),
        inverse_indices=(["b"], torch.tensor([[1, 1, 0]])),
    )
    w = ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(ebc(kjt)["b"], torch.stack([w[2], w[2], w[1]]))


def test_equal_strides_need_no_inverse_indices() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [1], [1]],
    )
    w0, w1 = ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(ebc(kjt).values(), torch.cat([w0[1], w0[3], w1[2]]).view(1, 16))


def _bad_inputs() -> list[tuple[KeyedJaggedTensor, str]]:
    good = _vbe_kjt()
    keys, index = good.inverse_indices()

    def with_inverse(inverse: tuple[list[str], torch.Tensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=good.keys(),
            values=good.values(),
            lengths=good.lengths(),
            stride_per_key_per_rank=good.stride_per_key_per_rank(),
            inverse_indices=inverse,
        )

    no_inverse = KeyedJaggedTensor(
        keys=good.keys(),
        values=good.values(),
        lengths=good.lengths(),
        stride_per_key_per_rank=good.stride_per_key_per_rank(),
    )
    too_far = index.clone()
    too_far[1, 2] = 3  # feature "a" has 3 bags
    return [
        (no_inverse, r"stride_per_key \[1, 3, 2\].*no inverse_indices"),
        (with_inverse((keys[:2], index[:2])), r"no row for features \['c'\]"),
        (with_inverse((keys, too_far)), r"feature 'a' hold 3.*0\.\.2"),
        (with_inverse((keys, index.float())), r"integer tensor"),
        (with_inverse((keys[:2], index)), r"2 keys.*\[3, 4\]"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_bad_variable_batch_raises_and_changes_nothing(case: int) -> None:
    kjt, message = _bad_inputs()[case]
    for fused in (False, True):
        torch.manual_seed(0)
        module: nn.Module = (
            FusedEmbeddingBagCollection(_tables()) if fused else EmbeddingBagCollection(_tables())
        )
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            module(kjt)
        for key, value in module.state_dict().items():
            torch.testing.assert_close(value, before[key], atol=0, rtol=0)
