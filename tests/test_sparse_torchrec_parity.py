"""TorchRec-compatible behaviour of the sparse types and the embedding-bag modules.

Each expected value is written out by hand from the layout's definition, not computed by
the code under test.
"""

from __future__ import annotations

import pytest
import torch

from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    FusedOptimizerConfig,
)
from recopt.sparse import IndexDtypeError, JaggedTensor, KeyedJaggedTensor, KeyedTensor


def bags(jt: JaggedTensor) -> list[list[float]]:
    return [bag.tolist() for bag in jt.to_dense()]


def test_float_values_and_integer_weights() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1.5, 2.5, 3.5, 4.5]),
        weights=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([2, 0, 1, 1], dtype=torch.int32),
    )
    assert kjt.values().dtype == torch.float32
    assert bags(kjt["a"]) == [[1.5, 2.5], []] and bags(kjt["b"]) == [[3.5], [4.5]]
    assert kjt["b"].weights().tolist() == [3, 4]
    assert kjt.length_per_key() == [2, 2] and kjt.offset_per_key() == [0, 2, 4]
    assert kjt.index_per_key() == {"a": 0, "b": 1}


def test_two_dimensional_values() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    jt = JaggedTensor(rows, offsets=torch.tensor([0, 2, 2, 3]))
    assert jt.lengths().tolist() == [2, 0, 1]
    assert [b.tolist() for b in jt.to_dense()] == [[[1.0, 2.0], [3.0, 4.0]], [], [[5.0, 6.0]]]
    padded = jt.to_padded_dense(desired_length=1, padding_value=-1.0)
    assert padded.tolist() == [[[1.0, 2.0]], [[-1.0, -1.0]], [[5.0, 6.0]]]


def test_to_padded_dense_and_from_dense_lengths() -> None:
    jt = JaggedTensor(torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 2]))
    assert jt.to_padded_dense().tolist() == [[1, 2], [0, 0], [3, 4]]
    assert jt.to_padded_dense(desired_length=1, padding_value=9).tolist() == [[1], [9], [3]]
    dense = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    back = JaggedTensor.from_dense_lengths(dense, torch.tensor([1, 3]))
    assert back.values().tolist() == [1.0, 4.0, 5.0, 6.0] and back.lengths().tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 3\]"):
        JaggedTensor.from_dense_lengths(dense, torch.tensor([1, 4]))


def variable_batch_kjt() -> KeyedJaggedTensor:
    # Feature a: 2 bags (one rank of 1, one of 1); feature b: 3 bags (ranks of 1 and 2).
    return KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([10, 11, 12, 20, 21, 22]),
        lengths=torch.tensor([2, 1, 0, 1, 2]),
        stride_per_key_per_rank=[[1, 1], [1, 2]],
    )


def test_variable_batch_per_feature() -> None:
    kjt = variable_batch_kjt()
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key() == [2, 3] and kjt.stride() == 3
    assert kjt.stride_per_key_per_rank() == [[1, 1], [1, 2]]
    assert kjt.lengths_offset_per_key() == [0, 2, 5]
    assert {k: bags(v) for k, v in kjt.to_dict().items()} == {
        "a": [[10, 11], [12]],
        "b": [[], [20], [21, 22]],
    }
    b_then_a = kjt.permute([1, 0])
    assert b_then_a.stride_per_key() == [3, 2]
    assert b_then_a.lengths().tolist() == [0, 1, 2, 2, 1]
    assert b_then_a.values().tolist() == [20, 21, 22, 10, 11, 12]
    left, right = kjt.split([1, 1])
    assert bags(right["b"]) == [[], [20], [21, 22]] and left.stride_per_key() == [2]
    joined = KeyedJaggedTensor.concat([right, left])
    assert joined.keys() == ["b", "a"] and joined.stride_per_key() == [3, 2]


def test_variable_batch_errors_and_inverse_indices() -> None:
    with pytest.raises(ValueError, match=r"adds up to 4 bags but lengths cover 5"):
        KeyedJaggedTensor(
            ["a", "b"],
            torch.arange(6),
            lengths=torch.tensor([2, 1, 0, 1, 2]),
            stride_per_key_per_rank=[[1, 1], [2]],
        )
    inverse = (["a", "b"], torch.tensor([[0, 1, 1, 0], [0, 1, 2, 2]]))
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.arange(6),
        lengths=torch.tensor([2, 1, 0, 1, 2]),
        stride_per_key_per_rank=[[2], [3]],
        inverse_indices=inverse,
    )
    assert kjt.stride() == 4 and kjt.inverse_indices()[0] == ["a", "b"]


def test_from_jt_dict_with_different_batch_sizes() -> None:
    a = JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([2]))
    b = JaggedTensor(torch.tensor([3]), lengths=torch.tensor([0, 1]))
    kjt = KeyedJaggedTensor.from_jt_dict({"a": a, "b": b})
    assert kjt.stride_per_key() == [1, 2] and kjt.lengths().tolist() == [2, 0, 1]


def test_empty_and_empty_like() -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True, values_dtype=torch.float32)
    assert empty.keys() == [] and empty.values().dtype == torch.float32
    assert empty.weights().numel() == 0
    like = KeyedJaggedTensor.empty_like(variable_batch_kjt())
    assert like.stride_per_key() == [2, 3] and like.lengths().tolist() == [0] * 5
    assert like.values().numel() == 0
    assert JaggedTensor.empty().lengths().numel() == 0


def test_accelerator_construction_defers_the_sums() -> None:
    # On meta (standing in for CUDA) nothing can be read: construction must not read lengths.
    kjt = KeyedJaggedTensor(
        ["a"], torch.zeros(3, device="meta"), lengths=torch.zeros(2, device="meta").long()
    )
    assert kjt.length_per_key_or_none() is None and kjt.stride() == 2
    # On the CPU the sums are checked at construction, with recopt's message.
    with pytest.raises(ValueError, match=r"feature 'a': lengths sum to 4 but it holds 3 ids"):
        KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([2, 2]))


def test_keyed_tensor_from_tensor_list_cat_dim() -> None:
    kt = KeyedTensor.from_tensor_list(
        ["x", "y"], [torch.ones(1, 2), torch.zeros(2, 2)], key_dim=0, cat_dim=0
    )
    assert kt.length_per_key() == [1, 2] and kt["y"].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert kt.device() == torch.device("cpu")


def tables(**extra: object) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t", num_embeddings=10, embedding_dim=4, feature_names=["f", "g"], **extra
        ),  # type: ignore[arg-type]
        EmbeddingBagConfig(name="u", num_embeddings=5, embedding_dim=8, feature_names=["h"]),
    ]


def test_ebc_on_meta_allocates_nothing_and_gives_shapes() -> None:
    ebc = EmbeddingBagCollection(tables(), device="meta")
    assert ebc.device == torch.device("meta")
    with torch.device("meta"):
        assert EmbeddingBagCollection(tables()).device == torch.device("meta")
    assert EmbeddingBagCollection(tables()).device == torch.device("cpu")
    kjt = KeyedJaggedTensor(
        ["f", "g", "h"],
        torch.zeros(6, dtype=torch.int64, device="meta"),
        lengths=torch.ones(6, dtype=torch.int64, device="meta"),
    )
    out = ebc(kjt)
    assert out.values().device.type == "meta" and tuple(out.values().shape) == (2, 16)
    assert out.keys() == ["f", "g", "h"] and out.length_per_key() == [4, 4, 8]


def test_init_fn_initialises_the_weight() -> None:
    def fill(weight: torch.Tensor) -> None:
        weight.fill_(0.25)

    ebc = EmbeddingBagCollection(tables(init_fn=fill))
    assert torch.equal(ebc.embedding_bags["t"].weight, torch.full((10, 4), 0.25))
    fused = FusedEmbeddingBagCollection(tables(init_fn=fill))
    assert torch.equal(fused.embedding_bags["t"].weight, torch.full((10, 4), 0.25))
    assert fused.device == torch.device("cpu")


def test_feature_shared_by_two_tables() -> None:
    shared = [
        EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=3, feature_names=["f"]),
        EmbeddingBagConfig(name="t2", num_embeddings=10, embedding_dim=2, feature_names=["f"]),
    ]
    ebc = EmbeddingBagCollection(shared)
    kjt = KeyedJaggedTensor.from_id_lists({"f": [[0, 1], [], [7]]})
    out = ebc(kjt)
    assert out.keys() == ["f@t1", "f@t2"] and out.length_per_key() == [3, 2]
    for key, table in (("f@t1", "t1"), ("f@t2", "t2")):
        weight = ebc.embedding_bags[table].weight.detach()
        expected = torch.stack([weight[0] + weight[1], torch.zeros_like(weight[0]), weight[7]])
        torch.testing.assert_close(out[key].detach(), expected)
    fused = FusedEmbeddingBagCollection(shared, optimizer=FusedOptimizerConfig(name="sgd"))
    fused.load_state_dict(ebc.state_dict())
    fused_out = fused(kjt)
    assert fused_out.keys() == ["f@t1", "f@t2"]
    torch.testing.assert_close(fused_out.values(), out.values().detach())


def test_reordering_all_keys_needs_no_counts() -> None:
    from recopt.sparse._kjt_helpers import reorder_on_device

    kjt = KeyedJaggedTensor.from_id_lists(
        {"a": [[1, 2], []], "b": [[3], [4, 5, 6]], "c": [[], [7]]},
        weights={"a": [[0.1, 0.2], []], "b": [[0.3], [0.4, 0.5, 0.6]], "c": [[], [0.7]]},
    )
    # The device path, run on the CPU for its numbers: c, a, b.
    reordered = reorder_on_device(kjt, [2, 0, 1])
    assert reordered.keys() == ["c", "a", "b"]
    assert reordered.lengths().tolist() == [0, 1, 2, 0, 1, 3]
    assert reordered.values().tolist() == [7, 1, 2, 3, 4, 5, 6]
    assert reordered.weights().tolist() == pytest.approx([0.7, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert reordered.length_per_key() == [1, 2, 4]
    # On meta (standing in for CUDA) a full reordering computes no per-key counts.
    meta = KeyedJaggedTensor(
        ["a", "b"], torch.zeros(5, device="meta"), lengths=torch.ones(4, device="meta").long()
    )
    swapped = meta.permute([1, 0])
    assert swapped.keys() == ["b", "a"] and swapped.length_per_key_or_none() is None
    assert meta.length_per_key_or_none() is None and swapped.values().shape == (5,)


def test_modules_need_inverse_indices_for_a_variable_batch() -> None:
    ebc = EmbeddingBagCollection(tables())
    kjt = KeyedJaggedTensor(
        ["f", "g", "h"],
        torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 0, 1]),
        stride_per_key_per_rank=[[1], [2], [1]],
    )
    with pytest.raises(ValueError, match=r"variable batch per feature .*no inverse_indices"):
        ebc(kjt)


def test_fused_collection_on_meta() -> None:
    fused = FusedEmbeddingBagCollection(tables(), device="meta")
    assert fused.device == torch.device("meta")
    assert fused.embedding_bags["u"].weight.device.type == "meta"
    kjt = KeyedJaggedTensor(
        ["h", "g", "f"],
        torch.zeros(3, dtype=torch.int64, device="meta"),
        lengths=torch.ones(3, dtype=torch.int64, device="meta"),
    )
    out = fused(kjt)
    assert out.values().device.type == "meta" and tuple(out.values().shape) == (1, 16)
    assert out.keys() == ["f", "g", "h"]


def test_regroup_as_dict() -> None:
    left = KeyedTensor(["a", "b"], [1, 2], torch.tensor([[1.0, 2.0, 3.0]]))
    right = KeyedTensor(["c"], [1], torch.tensor([[4.0]]))
    named = KeyedTensor.regroup_as_dict([left, right], [["c", "a"], ["b"]], ["x", "y"])
    assert named["x"].tolist() == [[4.0, 1.0]] and named["y"].tolist() == [[2.0, 3.0]]
    with pytest.raises(ValueError, match=r"regroup_as_dict: 1 names for 2 groups"):
        KeyedTensor.regroup_as_dict([left, right], [["c"], ["b"]], ["x"])


def test_float_lengths_raise_an_error_torchrec_code_catches() -> None:
    """recopt's ValueError, and TorchRec's AssertionError too; nothing is built."""
    values = torch.rand(7, 3)
    for kwargs in ({"lengths": torch.tensor([3.0, 4.0])}, {"offsets": torch.tensor([0.0, 7.0])}):
        with pytest.raises(IndexDtypeError, match="must have an integer dtype") as info:
            JaggedTensor(values=values, **kwargs)
        assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    with pytest.raises(AssertionError, match=r"lengths must have an integer dtype"):
        KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([2.0]))
