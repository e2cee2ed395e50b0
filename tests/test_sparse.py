"""Tests of recopt.sparse: jagged layouts against Python-list references, and every error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recopt.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, regroup

IdLists = dict[str, list[list[int]]]
WeightLists = dict[str, list[list[float]]]


# ---------------------------------------------------------------- helpers


@st.composite
def id_lists(draw: st.DrawFn) -> tuple[IdLists, WeightLists | None]:
    """Random small jagged batches: 0-4 features, 0-4 samples, 0-3 ids per bag."""
    num_keys = draw(st.integers(0, 4))
    stride = draw(st.integers(0, 4))
    bag = st.lists(st.integers(0, 99), max_size=3)
    ids = {f"f{k}": draw(st.lists(bag, min_size=stride, max_size=stride)) for k in range(num_keys)}
    if not draw(st.booleans()):
        return ids, None
    weights = {k: [[float(i) + 0.5 for i in b] for b in bags] for k, bags in ids.items()}
    return ids, weights


def as_lists(kjt: KeyedJaggedTensor) -> IdLists:
    return {key: [bag.tolist() for bag in jt.to_dense()] for key, jt in kjt.to_dict().items()}


def weights_as_lists(kjt: KeyedJaggedTensor) -> WeightLists | None:
    if kjt.weights_or_none() is None:
        return None
    out: WeightLists = {}
    for key, jt in kjt.to_dict().items():
        dense = jt.to_dense_weights()
        assert dense is not None
        out[key] = [w.tolist() for w in dense]
    return out


def assert_same(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys() == b.keys()
    assert a.stride() == b.stride()
    assert torch.equal(a.values(), b.values())
    assert torch.equal(a.lengths(), b.lengths())
    assert torch.equal(a.offsets(), b.offsets())
    assert a.length_per_key() == b.length_per_key()
    assert a.offset_per_key() == b.offset_per_key()
    wa, wb = a.weights_or_none(), b.weights_or_none()
    assert (wa is None) == (wb is None)
    if wa is not None and wb is not None:
        assert torch.equal(wa, wb)


def check_layout(kjt: KeyedJaggedTensor) -> None:
    """The invariants of docs/design.md hold on any KJT, including our own results."""
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int64
    assert kjt.lengths().numel() == len(kjt) * kjt.stride()
    assert kjt.offsets().tolist()[0] == 0
    assert torch.equal(kjt.offsets()[1:] - kjt.offsets()[:-1], kjt.lengths())
    assert kjt.offsets().tolist()[-1] == kjt.values().numel()
    opk = kjt.offset_per_key()
    assert len(opk) == len(kjt) + 1 and opk[-1] == kjt.values().numel()
    per_key = kjt.lengths().view(len(kjt), kjt.stride()).sum(1).tolist()
    assert kjt.length_per_key() == per_key


SAMPLE: IdLists = {"user": [[1, 2], [], [3]], "item": [[4], [5, 6, 7], []]}
# Binary fractions: exact in float32, so weights compare with ==.
SAMPLE_W: WeightLists = {"user": [[0.5, 0.25], [], [1.5]], "item": [[2.0], [2.5, 3.0, 0.125], []]}


def sample_kjt(weighted: bool = True) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(SAMPLE, SAMPLE_W if weighted else None)


# ---------------------------------------------------------------- construction


def test_constructions_agree() -> None:
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    weights = torch.tensor([0.5, 0.25, 1.5, 2.0, 2.5, 3.0, 0.125])
    lengths = torch.tensor([2, 0, 1, 1, 3, 0])
    offsets = torch.tensor([0, 2, 2, 3, 4, 7, 7])
    keys = ["user", "item"]
    reference = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)
    others = [
        KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, weights),
        KeyedJaggedTensor(keys, values, weights, lengths=lengths, offsets=offsets, stride=3),
        sample_kjt(),
        KeyedJaggedTensor.from_jt_dict(reference.to_dict()),
        KeyedJaggedTensor.from_jt_dict(
            {
                k: JaggedTensor.from_dense(
                    [torch.tensor(b, dtype=torch.int64) for b in SAMPLE[k]],
                    [torch.tensor(w) for w in SAMPLE_W[k]],
                )
                for k in keys
            }
        ),
    ]
    for other in others:
        assert_same(reference, other)
    check_layout(reference)
    assert reference.stride() == 3 and len(reference) == 2
    assert reference.length_per_key() == [3, 4]
    assert reference.offset_per_key() == [0, 3, 7]


def test_int32_inputs_become_int64() -> None:
    kjt = KeyedJaggedTensor.from_offsets_sync(
        ["a"], torch.tensor([5, 6], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    )
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().dtype == torch.int64 and kjt.offsets().dtype == torch.int64
    assert kjt.lengths().tolist() == [1, 1]


def test_int64_inputs_are_not_copied() -> None:
    values, lengths = torch.tensor([5, 6]), torch.tensor([2, 0])
    kjt = KeyedJaggedTensor(["a"], values, lengths=lengths)
    assert kjt.values() is values and kjt.lengths() is lengths


def test_explicit_stride_and_empty_bags() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([9]), lengths=torch.tensor([0, 0, 1, 0]))
    assert kjt.stride() == 2
    assert as_lists(kjt) == {"a": [[], []], "b": [[9], []]}


@pytest.mark.parametrize(
    "kjt",
    [
        KeyedJaggedTensor(
            [], torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int64)
        ),
        KeyedJaggedTensor.empty(),
        KeyedJaggedTensor.from_id_lists({}),
        KeyedJaggedTensor.from_jt_dict({}),
    ],
)
def test_kjt_without_keys(kjt: KeyedJaggedTensor) -> None:
    assert len(kjt) == 0 and kjt.keys() == [] and kjt.stride() == 0
    assert kjt.offsets().tolist() == [0]
    assert kjt.length_per_key() == [] and kjt.offset_per_key() == [0]
    assert kjt.to_dict() == {}
    assert kjt.permute([]).keys() == []
    assert kjt.split([0, 0])[1].keys() == []
    assert_same(KeyedJaggedTensor.concat([kjt, kjt]), kjt)


def test_kjt_with_keys_but_no_ids() -> None:
    kjt = KeyedJaggedTensor.empty(keys=["a", "b"], stride=3, is_weighted=True)
    check_layout(kjt)
    assert kjt.lengths().tolist() == [0] * 6 and kjt.weights().numel() == 0
    assert as_lists(kjt.permute([1, 1])) == {"b": [[], [], []]}
    assert weights_as_lists(kjt.split([1, 1])[1]) == {"b": [[], [], []]}
    from_lists = KeyedJaggedTensor.from_id_lists({"a": [[], []]})
    assert from_lists.values().numel() == 0 and from_lists.stride() == 2


def test_zero_stride_with_keys() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int64)
    )
    assert kjt.stride() == 0 and kjt.length_per_key() == [0, 0]
    assert as_lists(kjt.permute([1, 0])) == {"b": [], "a": []}


# ---------------------------------------------------------------- accessors


def test_getitem_returns_the_feature() -> None:
    kjt = sample_kjt()
    item = kjt["item"]
    assert item.values().tolist() == [4, 5, 6, 7]
    assert item.lengths().tolist() == [1, 3, 0]
    assert item.offsets().tolist() == [0, 1, 4, 4]
    assert item.weights().tolist() == [2.0, 2.5, 3.0, 0.125]
    assert [b.tolist() for b in item.to_dense()] == SAMPLE["item"]
    # Views, not copies: indexing is free.
    assert item.values().data_ptr() == kjt.values()[3:].data_ptr()


def test_getitem_of_a_missing_key() -> None:
    with pytest.raises(KeyError, match=r"feature 'nope' is not in this KeyedJaggedTensor"):
        sample_kjt()["nope"]


def test_weights_raises_when_unweighted() -> None:
    kjt = sample_kjt(weighted=False)
    assert kjt.weights_or_none() is None
    with pytest.raises(ValueError, match=r"has no weights; use weights_or_none\(\)"):
        kjt.weights()
    with pytest.raises(ValueError, match=r"JaggedTensor has no weights"):
        kjt["user"].weights()
    assert kjt["user"].to_dense_weights() is None


def test_accessor_lists_are_copies() -> None:
    kjt = sample_kjt()
    kjt.keys().append("x")
    kjt.length_per_key().append(1)
    kjt.offset_per_key().append(1)
    assert kjt.keys() == ["user", "item"]
    assert kjt.length_per_key() == [3, 4] and kjt.offset_per_key() == [0, 3, 7]


def test_to_device_keeps_everything() -> None:
    kjt = sample_kjt()
    moved = kjt.to("cpu", non_blocking=True)
    assert_same(kjt, moved)
    meta = kjt.to(torch.device("meta"))
    assert meta.device() == torch.device("meta")
    assert meta.weights().device == torch.device("meta")
    assert meta.length_per_key() == [3, 4]
    jt = kjt["user"].to("meta")
    assert jt.values().device.type == "meta" and jt.weights().device.type == "meta"


def test_with_values_swaps_the_values_and_keeps_the_rest() -> None:
    kjt = sample_kjt()
    kjt.length_per_key()  # counts known: the new KJT keeps them (no second check or sync)
    rows = torch.arange(100, 107)
    swapped = kjt.with_values(rows)
    assert swapped.values() is rows and swapped.weights() is kjt.weights()
    assert swapped.length_per_key_or_none() == [3, 4]
    assert torch.equal(swapped.lengths(), kjt.lengths()) and swapped.keys() == kjt.keys()
    assert swapped["item"].to_dense()[1].tolist() == [104, 105, 106]
    assert torch.equal(kjt.values(), torch.arange(1, 8))  # the original is untouched
    for bad in (torch.arange(6), torch.zeros(7, 2)):
        with pytest.raises(ValueError, match=r"with_values: .* need \(7,\)"):
            kjt.with_values(bad)


def test_repr_is_readable() -> None:
    text = repr(sample_kjt(weighted=False))
    assert text.startswith("KeyedJaggedTensor(stride=3, weighted=False")
    assert "'user': [[1, 2], [], [3]]" in text and "'item': [[4], [5, 6, 7], []]" in text
    assert "1*0.5" in repr(sample_kjt())
    big = KeyedJaggedTensor(["a"], torch.arange(100), lengths=torch.tensor([100]))
    assert repr(big) == "KeyedJaggedTensor(stride=1, weighted=False, ids per key={'a': 100})"
    assert repr(big["a"]) == "JaggedTensor(num_bags=1, num_values=100)"
    assert repr(sample_kjt()["user"]) == "JaggedTensor([[1*0.5, 2*0.25], [], [3*1.5]])"


# ---------------------------------------------------------------- split / permute / concat


@settings(max_examples=60, deadline=None)
@given(data=id_lists(), cut_draws=st.lists(st.integers(0, 4), max_size=4))
def test_split_matches_reference(
    data: tuple[IdLists, WeightLists | None], cut_draws: list[int]
) -> None:
    ids, weights = data
    kjt = KeyedJaggedTensor.from_id_lists(ids, weights)
    keys = list(ids)
    # Sorted cut points (repeats allowed) give consecutive segments, some of size 0.
    bounds = [0, *sorted(min(c, len(keys)) for c in cut_draws), len(keys)]
    segments = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
    parts = kjt.split(segments)
    assert len(parts) == len(segments)
    start = 0
    for size, part in zip(segments, parts, strict=True):
        part_keys = keys[start : start + size]
        check_layout(part)
        assert part.stride() == kjt.stride()
        assert as_lists(part) == {k: ids[k] for k in part_keys}
        if weights is not None:
            assert weights_as_lists(part) == {k: weights[k] for k in part_keys}
        else:
            assert part.weights_or_none() is None
        start += size
    assert_same(KeyedJaggedTensor.concat(parts), kjt)


@settings(max_examples=60, deadline=None)
@given(data=id_lists(), picks=st.lists(st.integers(0, 100), max_size=6))
def test_permute_matches_reference(
    data: tuple[IdLists, WeightLists | None], picks: list[int]
) -> None:
    ids, weights = data
    kjt = KeyedJaggedTensor.from_id_lists(ids, weights)
    keys = list(ids)
    indices = [p % len(keys) for p in picks] if keys else []
    permuted = kjt.permute(indices)
    check_layout(permuted)
    assert permuted.keys() == [keys[i] for i in indices]
    assert permuted.stride() == kjt.stride()
    for position, index in enumerate(indices):
        key = keys[index]
        jt = permuted.split([position, 1, len(indices) - position - 1])[1][key]
        assert [b.tolist() for b in jt.to_dense()] == ids[key]
        if weights is not None:
            dense = jt.to_dense_weights()
            assert dense is not None and [w.tolist() for w in dense] == weights[key]
    assert (permuted.weights_or_none() is None) == (weights is None)


@settings(max_examples=40, deadline=None)
@given(data=id_lists())
def test_round_trips(data: tuple[IdLists, WeightLists | None]) -> None:
    ids, weights = data
    kjt = KeyedJaggedTensor.from_id_lists(ids, weights)
    check_layout(kjt)
    assert as_lists(kjt) == ids
    assert weights_as_lists(kjt) == weights
    if keys := kjt.keys():  # with no keys, from_jt_dict cannot know the KJT was weighted
        assert_same(KeyedJaggedTensor.from_jt_dict(kjt.to_dict()), kjt)
        assert list(ids) == keys
    assert_same(
        KeyedJaggedTensor.from_offsets_sync(
            kjt.keys(), kjt.values(), kjt.offsets(), kjt.weights_or_none(), kjt.stride()
        ),
        kjt,
    )
    assert_same(kjt.permute(list(range(len(kjt)))), kjt)
    reverse = list(range(len(kjt)))[::-1]
    assert_same(kjt.permute(reverse).permute(reverse), kjt)


def test_permute_repeats_and_drops_keys_with_weights() -> None:
    kjt = sample_kjt()
    permuted = kjt.permute([1, 1])
    assert permuted.keys() == ["item", "item"]
    assert permuted.values().tolist() == [4, 5, 6, 7, 4, 5, 6, 7]
    assert permuted.lengths().tolist() == [1, 3, 0, 1, 3, 0]
    assert permuted.weights().tolist() == [2.0, 2.5, 3.0, 0.125] * 2
    assert permuted.length_per_key() == [4, 4] and permuted.offset_per_key() == [0, 4, 8]


def test_split_gives_views() -> None:
    kjt = sample_kjt()
    user, item = kjt.split([1, 1])
    assert item.values().data_ptr() == kjt.values()[3:].data_ptr()
    assert item.weights().data_ptr() == kjt.weights()[3:].data_ptr()
    assert item.offsets().tolist() == [0, 1, 4, 4]
    assert user.weights().tolist() == [0.5, 0.25, 1.5]


def test_concat_carries_weights_and_keys() -> None:
    kjt = sample_kjt()
    other = KeyedJaggedTensor.from_id_lists({"page": [[8], [], [9]]}, {"page": [[0.75], [], [4.0]]})
    joined = KeyedJaggedTensor.concat([other, kjt])
    check_layout(joined)
    assert joined.keys() == ["page", "user", "item"]
    assert as_lists(joined) == {"page": [[8], [], [9]], **SAMPLE}
    assert weights_as_lists(joined) == {"page": [[0.75], [], [4.0]], **SAMPLE_W}


# ---------------------------------------------------------------- JaggedTensor


def test_jagged_tensor_basics() -> None:
    jt = JaggedTensor(torch.tensor([7, 8, 9]), lengths=torch.tensor([2, 0, 1], dtype=torch.int32))
    assert jt.offsets().tolist() == [0, 2, 2, 3]
    assert jt.lengths().dtype == torch.int64
    assert [b.tolist() for b in jt.to_dense()] == [[7, 8], [], [9]]
    assert jt.weights_or_none() is None
    from_offsets = JaggedTensor(torch.tensor([7, 8, 9]), offsets=torch.tensor([0, 2, 2, 3]))
    assert from_offsets.lengths().tolist() == [2, 0, 1]
    floats = JaggedTensor(torch.tensor([0.5, 1.5]), lengths=torch.tensor([1, 1]))
    assert floats.values().dtype == torch.float32  # a generic jagged container keeps floats


def test_jagged_tensor_from_dense() -> None:
    bags = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64), torch.tensor([3])]
    weights = [torch.tensor([0.5, 0.25]), torch.tensor([]), torch.tensor([2.0])]
    jt = JaggedTensor.from_dense(bags, weights)
    assert jt.values().tolist() == [1, 2, 3] and jt.lengths().tolist() == [2, 0, 1]
    assert jt.weights().tolist() == [0.5, 0.25, 2.0]
    dense = jt.to_dense_weights()
    assert dense is not None and [w.tolist() for w in dense] == [[0.5, 0.25], [], [2.0]]
    empty = JaggedTensor.from_dense([])
    assert empty.values().numel() == 0 and empty.offsets().tolist() == [0]


def test_jagged_tensor_errors() -> None:
    values = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"pass lengths or offsets .*neither was given"):
        JaggedTensor(values)
    with pytest.raises(ValueError, match=r"^bag 1: length -2 is negative"):
        JaggedTensor(values, lengths=torch.tensor([1, -2, 4]))
    with pytest.raises(ValueError, match=r"^lengths sum to 4 but values hold 3 ids"):
        JaggedTensor(values, lengths=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"values must have at least one dimension"):
        JaggedTensor(values[0], lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"from_dense: bag 1 must be a 1-D tensor"):
        JaggedTensor.from_dense([values, values.view(3, 1)])
    with pytest.raises(ValueError, match=r"from_dense: 1 weight tensors for 2 bags"):
        JaggedTensor.from_dense([values, values], [torch.ones(3)])
    with pytest.raises(ValueError, match=r"from_dense: bag 0 has 3 entries but 2 weights"):
        JaggedTensor.from_dense([values], [torch.ones(2)])


# ---------------------------------------------------------------- validation errors

VALUES = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
KEYS = ["user_id", "f2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"lengths": torch.tensor([3, 3, 4, 0, 0, 0])},
            r"^feature 'user_id': lengths sum to 10 but it holds 8 ids \(values\[0:8\]\)",
        ),
        (
            {"lengths": torch.tensor([1, 1, 1, 2, 2, 3])},
            r"^feature 'f2': lengths sum to 7 but it holds 5 ids \(values\[3:8\]\)",
        ),
        (
            {"lengths": torch.tensor([1, 1, 1, 1, 1, 1])},
            r"^feature 'f2': lengths sum to 3 but it holds 5 ids \(values\[3:8\]\); lengths "
            r"must sum to len\(values\) = 8",
        ),
        (
            {"lengths": torch.tensor([3, 0, 1, 2, 4, -1, 0, 1]), "stride": 4},
            r"^feature 'f2', bag 1: length -1 is negative",
        ),
        (
            {"offsets": torch.tensor([1, 2, 3, 4, 5, 6, 8])},
            r"^offsets start at 1 but must start at 0",
        ),
        (
            {"offsets": torch.tensor([0, 2, 3, 4, 5, 6, 7])},
            r"^offsets end at 7 but values hold 8 ids; the last offset must equal len\(values\)",
        ),
        (
            {"offsets": torch.tensor([0, 2, 3, 4, 6, 5, 8])},
            r"^feature 'f2', bag 1: offsets decrease by 1; they must be non-decreasing",
        ),
        # Empty offsets mean no bags (as in TorchRec); with 8 ids that is an error.
        ({"offsets": torch.tensor([], dtype=torch.int64)}, r"offsets end at 0 but values hold 8"),
        (
            {
                "lengths": torch.tensor([2, 1, 1, 2, 1, 1]),
                "offsets": torch.tensor([0, 2, 3, 4, 5, 7, 8]),
            },
            r"^feature 'f2', bag 0: lengths say 2 but offsets say 1",
        ),
        (
            {"lengths": torch.tensor([2, 1, 1, 2, 1, 1]), "offsets": torch.tensor([0, 8])},
            r"offsets has 2 entries but lengths has 6; offsets needs one more entry",
        ),
        (
            {"lengths": torch.tensor([4, 4, 0, 0, 0, 0]), "stride": 2},
            r"lengths covers 6 bags but 2 keys x stride 2 need 4",
        ),
        (
            {"lengths": torch.tensor([4, 4, 0])},
            r"lengths covers 3 bags, not a multiple of the 2 keys",
        ),
        (
            {"lengths": torch.tensor([8, 0]), "stride": -1},
            r"stride must be a non-negative int, got -1",
        ),
        (
            {"lengths": torch.tensor([4.0, 4.0])},
            r"lengths must have an integer dtype, got torch.float32",
        ),
        ({"lengths": [4, 4]}, r"lengths must be a torch.Tensor, got list"),
        ({"lengths": torch.tensor([[4, 4]])}, r"lengths must be 1-D, got shape \[1, 2\]"),
        ({}, r"pass lengths or offsets"),
        (
            {"lengths": torch.tensor([4, 4]), "weights": torch.ones(8, dtype=torch.bool)},
            r"weights must be real numbers, got torch.bool",
        ),
        (
            {"lengths": torch.tensor([4, 4]), "weights": torch.ones(7)},
            r"weights has shape \[7\] but values has \[8\]; give exactly one weight per id",
        ),
        (
            {"lengths": torch.tensor([4, 4]), "weights": torch.ones(8, device="meta")},
            r"weights are on meta but values on cpu",
        ),
        (
            {"lengths": torch.tensor([4, 4], device="meta")},
            r"lengths is on meta but values on cpu",
        ),
    ],
)
def test_kjt_validation_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(KEYS, VALUES, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keys", "values", "message"),
    [
        (["a", "a"], VALUES, r"keys must be unique, but 'a' appears more than once"),
        (["a", 3], VALUES, r"keys must be strings, got 3 \(int\) at position 1"),
        ("ab", VALUES, r"keys must be a list of strings, got the string 'ab'"),
        (["a", "b"], VALUES[0], r"values must have at least one dimension"),
        (["a", "b"], [1, 2], r"values must be a torch.Tensor, got list"),
    ],
)
def test_kjt_key_and_value_errors(keys: object, values: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(keys, values, lengths=torch.tensor([4, 4]))  # type: ignore[arg-type]


def test_no_keys_but_ids() -> None:
    with pytest.raises(ValueError, match=r"with no keys holds no ids, but values has 8"):
        KeyedJaggedTensor([], VALUES, lengths=torch.empty(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"lengths covers 2 bags but there are no keys"):
        KeyedJaggedTensor([], VALUES, lengths=torch.tensor([4, 4]))


def test_from_id_lists_errors() -> None:
    with pytest.raises(ValueError, match=r"feature 'b' has 1 samples but feature 'a' has 2"):
        KeyedJaggedTensor.from_id_lists({"a": [[1], []], "b": [[2]]})
    with pytest.raises(ValueError, match=r"weights have features \['b', 'a'\] but ids have"):
        KeyedJaggedTensor.from_id_lists({"a": [[1]], "b": [[2]]}, {"b": [[1.0]], "a": [[1.0]]})
    with pytest.raises(ValueError, match=r"feature 'a', sample 1: 1 weights for 2 ids"):
        KeyedJaggedTensor.from_id_lists({"a": [[1], [2, 3]]}, {"a": [[1.0], [1.0]]})
    with pytest.raises(ValueError, match=r"feature 'a': weights have 1 samples but ids have 2"):
        KeyedJaggedTensor.from_id_lists({"a": [[1], []]}, {"a": [[1.0]]})


def test_from_jt_dict_errors() -> None:
    short = JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1]))
    longer = JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1, 0]))
    weighted = JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1]), weights=torch.ones(1))
    # Different bag counts are a variable batch per feature (TorchRec's behaviour).
    assert KeyedJaggedTensor.from_jt_dict({"a": short, "b": longer}).stride_per_key() == [1, 2]
    with pytest.raises(ValueError, match=r"feature 'a' is unweighted but 'b' is not"):
        KeyedJaggedTensor.from_jt_dict({"a": short, "b": weighted})


def test_split_permute_concat_errors() -> None:
    kjt = sample_kjt()
    with pytest.raises(ValueError, match=r"split: segments \[1, 2\] sum to 3 but there are 2 keys"):
        kjt.split([1, 2])
    with pytest.raises(ValueError, match=r"split: segment sizes must be non-negative ints, got -1"):
        kjt.split([3, -1])
    with pytest.raises(ValueError, match=r"permute: index 2 is not in range\(2\) of the keys"):
        kjt.permute([0, 2])
    with pytest.raises(ValueError, match=r"permute: index -1 is not in range\(2\)"):
        kjt.permute([-1])
    with pytest.raises(ValueError, match=r"concat needs at least one KeyedJaggedTensor"):
        KeyedJaggedTensor.concat([])
    with pytest.raises(ValueError, match=r"concat: key 'user' is in input 0 and input 1"):
        KeyedJaggedTensor.concat([kjt, kjt])
    other = KeyedJaggedTensor.from_id_lists({"page": [[1]]})
    with pytest.raises(ValueError, match=r"concat: input 1 has stride 1 but input 0 has 3"):
        KeyedJaggedTensor.concat([kjt, other])
    unweighted = KeyedJaggedTensor.from_id_lists({"page": [[1], [], []]})
    with pytest.raises(ValueError, match=r"concat: input 1 and input 0 differ in having weights"):
        KeyedJaggedTensor.concat([kjt, unweighted])
    with pytest.raises(ValueError, match=r"stride must be a non-negative int, got -2"):
        KeyedJaggedTensor.empty(keys=["a"], stride=-2)


# ---------------------------------------------------------------- KeyedTensor


def make_kt() -> KeyedTensor:
    return KeyedTensor.from_tensor_list(
        ["a", "b", "c"], [torch.full((2, 2), 1.0), torch.full((2, 3), 2.0), torch.full((2, 1), 3.0)]
    )


def test_keyed_tensor_accessors() -> None:
    kt = make_kt()
    assert kt.keys() == ["a", "b", "c"] and len(kt) == 3
    assert kt.length_per_key() == [2, 3, 1] and kt.offset_per_key() == [0, 2, 5, 6]
    assert kt.values().shape == (2, 6) and kt.key_dim() == 1
    b = kt["b"]
    assert b.shape == (2, 3) and bool((b == 2.0).all())
    b[0, 0] = 9.0  # a view: writes reach the whole tensor
    assert kt.values()[0, 2].item() == 9.0
    as_dict = kt.to_dict()
    assert list(as_dict) == ["a", "b", "c"] and as_dict["c"].shape == (2, 1)
    assert "KeyedTensor(shape=[2, 6]" in repr(kt)
    assert kt.to("meta").values().device.type == "meta"
    with pytest.raises(KeyError, match=r"feature 'z' is not in this KeyedTensor"):
        kt["z"]


def test_keyed_tensor_other_key_dim() -> None:
    kt = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).view(3, 2).T, key_dim=1)
    assert kt["y"].tolist() == [[2.0, 4.0], [3.0, 5.0]]
    rows = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).view(3, 2), key_dim=0)
    assert rows["y"].tolist() == [[2.0, 3.0], [4.0, 5.0]]


def test_regroup_takes_keys_from_each_input() -> None:
    first = make_kt()
    second = KeyedTensor(["d", "e"], [1, 1], torch.tensor([[4.0, 5.0], [40.0, 50.0]]))
    grouped = regroup([first, second], [["e", "a"], ["b", "c"], ["d"], []])
    assert [t.shape for t in grouped] == [(2, 3), (2, 4), (2, 1), (2, 0)]
    assert grouped[0].tolist() == [[5.0, 1.0, 1.0], [50.0, 1.0, 1.0]]
    assert torch.equal(grouped[1], first.values()[:, 2:])
    assert grouped[2].tolist() == [[4.0], [40.0]]
    assert KeyedTensor.regroup is regroup


def test_regroup_gradient() -> None:
    left = torch.randn(3, 4, requires_grad=True)
    right = torch.randn(3, 2, requires_grad=True)
    kts = [KeyedTensor(["a", "b"], [1, 3], left), KeyedTensor(["c"], [2], right)]
    out_1, out_2 = regroup(kts, [["c", "a"], ["b", "a"]])
    (out_1 * 2.0).sum().backward(retain_graph=True)
    (out_2 * 3.0).sum().backward()
    assert left.grad is not None and right.grad is not None
    expected_left = torch.full((3, 4), 3.0)
    expected_left[:, 0] = 5.0  # "a" feeds both groups
    assert torch.equal(left.grad, expected_left)
    assert torch.equal(right.grad, torch.full((3, 2), 2.0))


def test_keyed_tensor_errors() -> None:
    values = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"length_per_key sums to 4 but values has 5 columns"):
        KeyedTensor(["a", "b"], [2, 2], values)
    with pytest.raises(ValueError, match=r"length_per_key has 1 entries but there are 2 keys"):
        KeyedTensor(["a", "b"], [5], values)
    with pytest.raises(ValueError, match=r"key 'b': width -1 must be a non-negative int"):
        KeyedTensor(["a", "b"], [6, -1], values)
    with pytest.raises(ValueError, match=r"keys must be unique, but 'a' appears more than once"):
        KeyedTensor(["a", "a"], [2, 3], values)
    with pytest.raises(ValueError, match=r"key_dim 2 is not a dimension of values"):
        KeyedTensor(["a"], [5], values, key_dim=2)
    with pytest.raises(ValueError, match=r"from_tensor_list: 2 keys but 1 tensors"):
        KeyedTensor.from_tensor_list(["a", "b"], [values])
    with pytest.raises(ValueError, match=r"from_tensor_list needs at least one tensor"):
        KeyedTensor.from_tensor_list([], [])


def test_regroup_errors() -> None:
    kt = make_kt()
    with pytest.raises(ValueError, match=r"regroup: key 'z' is in no input"):
        regroup([kt], [["a", "z"]])
    with pytest.raises(ValueError, match=r"regroup: key 'a' is in input 0 and input 1"):
        regroup([kt, kt], [["a"]])
    other_batch = KeyedTensor(["d"], [1], torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"regroup: input 1 has shape \[3, 1\] but input 0 has"):
        regroup([kt, other_batch], [["a", "d"]])
    rows = KeyedTensor(["d"], [2], torch.zeros(2, 2), key_dim=0)
    with pytest.raises(ValueError, match=r"regroup: input 1 has key_dim 0 but input 0 has 1"):
        regroup([kt, rows], [["d"]])
