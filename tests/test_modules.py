"""EmbeddingBagCollection and FusedEmbeddingBagCollection against plain-torch references."""

from __future__ import annotations

import pickle

import pytest
import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    InvalidIdError,
    validate_tables,
)
from recopt.sparse import KeyedJaggedTensor

FBGEMM = Backend.FBGEMM


def tables(pooling: str = "sum", shared: bool = True) -> list[EmbeddingBagConfig]:
    """t0 is looked up by features a and b (shared=True), or b has its own table t0b."""
    first = [
        EmbeddingBagConfig(
            name="t0",
            num_embeddings=10,
            embedding_dim=4,
            feature_names=["a", "b"] if shared else ["a"],
        )
    ]
    if not shared:
        first.append(
            EmbeddingBagConfig(name="t0b", num_embeddings=10, embedding_dim=4, feature_names=["b"])
        )
    return first + [
        EmbeddingBagConfig(
            name="t1", num_embeddings=6, embedding_dim=8, feature_names=["c"], pooling=pooling
        ),
    ]


def batch(weighted: bool = False) -> KeyedJaggedTensor:
    # Ids repeat inside a bag (a: 1,1), across bags (c: 5 twice) and across features of one
    # table (a and b both read t0 row 2); b has an empty bag.
    ids = {"a": [[1, 1, 2], [2]], "b": [[2], []], "c": [[0, 5], [5]]}
    weights = {"a": [[1.0, 2.0, 0.5], [3.0]], "b": [[0.5], []], "c": [[2.0, 3.0], [1.0]]}
    return KeyedJaggedTensor.from_id_lists(ids, weights=weights if weighted else None)


def make_pair(
    optimizer: FusedOptimizerConfig, pooling: str = "sum", weighted: bool = False
) -> tuple[EmbeddingBagCollection, FusedEmbeddingBagCollection]:
    # fbgemm's CPU adagrad kernels refuse a table shared by two features (recopt.kernels.factory)
    shared = optimizer.backend != FBGEMM or optimizer.name == "sgd"
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(pooling, shared), is_weighted=weighted)
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(
        tables(pooling, shared), optimizer=optimizer, is_weighted=weighted
    )
    return ebc, fused


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_forward_equals_plain(pooling: str, weighted: bool) -> None:
    ebc, fused = make_pair(FusedOptimizerConfig(name="sgd"), pooling, weighted)
    kjt = batch(weighted)
    expected, actual = ebc(kjt), fused(kjt)
    assert actual.keys() == ["a", "b", "c"] == expected.keys()
    assert actual.length_per_key() == [4, 4, 8]
    torch.testing.assert_close(actual.values(), expected.values(), rtol=0, atol=1e-6)
    for name in ("t0", "t1"):
        torch.testing.assert_close(
            fused.state_dict()[f"embedding_bags.{name}.weight"],
            ebc.state_dict()[f"embedding_bags.{name}.weight"],
        )


def test_forward_matches_hand_computation() -> None:
    ebc = EmbeddingBagCollection(tables())
    w0 = ebc.state_dict()["embedding_bags.t0.weight"]
    kt = ebc(batch())
    torch.testing.assert_close(kt["a"][0], 2 * w0[1] + w0[2])
    torch.testing.assert_close(kt["b"][1], torch.zeros(4))  # empty bag pools to zero


def row_gradients(
    ebc: EmbeddingBagCollection, kjt: KeyedJaggedTensor, upstream: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Dense gradient of each table for loss = sum(pooled * upstream)."""
    ebc.zero_grad()
    (ebc(kjt).values() * upstream).sum().backward()
    return {n: b.weight.grad.clone() for n, b in ebc.embedding_bags.items()}


def reference_step(
    name: str, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], lr: float
) -> None:
    """The update each fused optimizer must apply, written out in plain torch."""
    touched = g.abs().sum(dim=1) > 0  # only rows present in the batch are updated
    eps = 1e-8
    if name == "sgd":
        w -= lr * g
    elif name == "adagrad":
        state["momentum1"] += g * g
        w[touched] -= lr * g[touched] / (state["momentum1"][touched].sqrt() + eps)
    elif name == "row_wise_adagrad":
        # Row-wise Adagrad: one accumulator per row, grown by the mean of the row's squared
        # gradient; every element of the row is scaled by the same 1 / (sqrt(acc) + eps).
        state["momentum1"][touched] += (g[touched] ** 2).mean(dim=1)
        w[touched] -= lr * g[touched] / (state["momentum1"][touched].sqrt().unsqueeze(1) + eps)


@pytest.mark.parametrize("backend", [Backend.FBGEMM, Backend.RECOPT])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_wise_adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_steps_equal_reference(name: str, weighted: bool, backend: Backend) -> None:
    lr = 0.1
    ebc, fused = make_pair(
        FusedOptimizerConfig(name=name, lr=lr, backend=backend), weighted=weighted
    )
    weights = {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}
    state_shape = {"adagrad": lambda r, d: (r, d), "row_wise_adagrad": lambda r, d: (r,)}
    states = {
        t.name: {"momentum1": torch.zeros(state_shape[name](t.num_embeddings, t.embedding_dim))}
        for t in fused.tables
        if name in state_shape
    }
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        kjt = batch(weighted)
        upstream = torch.randn(2, 16, generator=generator)
        for n, b in ebc.embedding_bags.items():
            b.weight.data.copy_(weights[n])
        grads = row_gradients(ebc, kjt, upstream)
        for n in weights:
            reference_step(name, weights[n], grads[n], states.get(n, {}), lr)
        (fused(kjt).values() * upstream).sum().backward()
    sd = fused.fused_optimizer.state_dict()["state"]
    for n in weights:
        torch.testing.assert_close(fused.embedding_bags[n].weight, weights[n], atol=1e-5, rtol=1e-5)
        for key, value in states.get(n, {}).items():
            torch.testing.assert_close(sd[f"embedding_bags.{n}.weight"][f"{n}.{key}"], value)


def test_fused_optimizer_exposes_params_and_state_in_place() -> None:
    _, fused = make_pair(FusedOptimizerConfig(name="row_wise_adagrad", backend=FBGEMM))
    opt = fused.fused_optimizer
    assert "embedding_bags.t0b.weight" in opt.params  # fbgemm: b has its own table
    state = opt.state_dict()["state"]["embedding_bags.t1.weight"]
    assert list(state) == ["t1.momentum1"] and state["t1.momentum1"].shape == (6,)
    state["t1.momentum1"].fill_(4.0)  # written in place: the kernel sees it
    fused(batch()).values().sum().backward()
    after = opt.state_dict()["state"]["embedding_bags.t1.weight"]["t1.momentum1"]
    assert after[1].item() == 4.0  # row 1 untouched by the batch
    assert after[0].item() > 4.0


def test_lr_change_reaches_kernel() -> None:
    _, fused = make_pair(FusedOptimizerConfig(name="sgd", lr=0.1, backend=FBGEMM))
    fused.fused_optimizer.param_groups[0]["lr"] = 0.0
    before = fused.embedding_bags["t0"].weight.clone()
    fused(batch()).values().sum().backward()
    torch.testing.assert_close(fused.embedding_bags["t0"].weight, before, rtol=0, atol=0)
    fused.fused_optimizer.param_groups[0]["lr"] = 0.5
    fused(batch()).values().sum().backward()
    assert not torch.equal(fused.embedding_bags["t0"].weight, before)


def test_load_state_dict_writes_into_kernel() -> None:
    ebc, fused = make_pair(FusedOptimizerConfig(name="sgd", backend=FBGEMM))
    with torch.no_grad():
        for b in ebc.embedding_bags.values():
            b.weight.mul_(3.0)
    fused.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(fused(batch()).values(), ebc(batch()).values())


def test_per_table_optimizers_make_separate_kernels() -> None:
    fused = FusedEmbeddingBagCollection(
        tables(),
        optimizer=FusedOptimizerConfig(name="sgd", lr=0.1, backend=FBGEMM),
        table_optimizers={"t1": FusedOptimizerConfig(name="adagrad", lr=0.1, backend=FBGEMM)},
    )
    assert len(fused.kernels()) == 2
    groups = fused.fused_optimizer.param_groups
    assert [g["optimizer"] for g in groups] == ["sgd", "adagrad"]
    ebc = EmbeddingBagCollection(tables())
    ebc.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fused(batch()).values(), ebc(batch()).values())


def test_sparse_gradients() -> None:
    ebc = EmbeddingBagCollection(tables(), sparse_grad=True)
    ebc(batch()).values().sum().backward()
    assert ebc.embedding_bags["t0"].weight.grad.is_sparse


@pytest.mark.parametrize("bad_id", [10, -1, 1 << 40])
def test_out_of_range_ids_raise_and_update_nothing(bad_id: int) -> None:
    ebc, fused = make_pair(FusedOptimizerConfig(name="sgd", backend=FBGEMM))
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    kjt = KeyedJaggedTensor.from_id_lists({"a": [[1], [2]], "b": [[bad_id], []], "c": [[0], [5]]})
    for module in (ebc, fused):
        with pytest.raises(InvalidIdError, match=rf"table 't0', feature 'b': id {bad_id} is out"):
            module(kjt)
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key])


def test_bad_inputs() -> None:
    _, fused = make_pair(FusedOptimizerConfig(name="sgd"))
    with pytest.raises(ValueError, match=r"missing features \['c'\]"):
        fused(KeyedJaggedTensor.from_id_lists({"a": [[1]], "b": [[2]]}))
    with pytest.raises(ValueError, match="is_weighted=False"):
        fused(batch(weighted=True))
    weighted = FusedEmbeddingBagCollection(tables(), is_weighted=True)
    with pytest.raises(ValueError, match="no weights"):
        weighted(batch())


def test_input_feature_order_and_extra_keys_do_not_matter() -> None:
    ebc = EmbeddingBagCollection(tables())
    ids = {"c": [[0, 5], [5]], "x": [[7], [7]], "b": [[2], []], "a": [[1, 1, 2], [2]]}
    torch.testing.assert_close(
        ebc(KeyedJaggedTensor.from_id_lists(ids)).values(), ebc(batch()).values()
    )


def test_config_validation() -> None:
    t = tables()
    with pytest.raises(ValueError, match="table 't0' is configured twice"):
        validate_tables([t[0], t[0]])
    clash = EmbeddingBagConfig(name="t2", num_embeddings=3, embedding_dim=4, feature_names=["a"])
    with pytest.raises(ValueError, match="feature 'a' is in two tables, 't0' and 't2'"):
        validate_tables([t[0], clash])
    with pytest.raises(ValueError, match="table 'x': embedding_dim must be an int >= 1, got 0"):
        EmbeddingBagConfig(name="x", num_embeddings=3, embedding_dim=0, feature_names=["f"])
    with pytest.raises(ValueError, match="table 'x': num_embeddings must be"):
        EmbeddingBagConfig(name="x", num_embeddings=0, embedding_dim=4, feature_names=["f"])
    with pytest.raises(ValueError, match="feature_names is empty"):
        EmbeddingBagConfig(name="x", num_embeddings=3, embedding_dim=4)
    with pytest.raises(ValueError, match="'median'"):
        EmbeddingBagConfig(
            name="x", num_embeddings=3, embedding_dim=4, feature_names=["f"], pooling="median"
        )
    odd = EmbeddingBagConfig(name="odd", num_embeddings=3, embedding_dim=6, feature_names=["f"])
    with pytest.raises(
        ValueError, match="table 'odd': embedding_dim 6 is not a multiple of 4.*use 8"
    ):
        FusedEmbeddingBagCollection(
            [odd], optimizer=FusedOptimizerConfig(name="sgd", backend=FBGEMM)
        )
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\]"):
        FusedEmbeddingBagCollection(tables(), table_optimizers={"nope": FusedOptimizerConfig()})


def test_configs_and_plain_module_pickle() -> None:
    t = tables()
    assert pickle.loads(pickle.dumps(t)) == t
    ebc = EmbeddingBagCollection(t)
    clone = pickle.loads(pickle.dumps(ebc))
    torch.testing.assert_close(clone(batch()).values(), ebc(batch()).values())


@pytest.mark.parametrize("backend", [Backend.FBGEMM, Backend.RECOPT])
def test_deepcopy_keeps_weights_tied_to_the_copied_kernel(backend: Backend) -> None:
    import copy

    _, fused = make_pair(FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1, backend=backend))
    fused.fused_optimizer.param_groups[0]["lr"] = 0.3
    clone = copy.deepcopy(fused)
    original = {k: v.clone() for k, v in fused.state_dict().items()}
    before = {k: v.clone() for k, v in clone.state_dict().items()}
    clone(batch()).values().sum().backward()
    after = clone.state_dict()
    assert not torch.equal(after["embedding_bags.t0.weight"], before["embedding_bags.t0.weight"])
    for key, value in fused.state_dict().items():  # the original is untouched
        assert torch.equal(value, original[key])
    assert clone.fused_optimizer.param_groups[0]["lr"] == 0.3
    state = clone.fused_optimizer.state_dict()["state"]["embedding_bags.t1.weight"]["t1.momentum1"]
    assert state.abs().sum() > 0  # the copy's optimizer shows the copy's kernel state


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float64])
def test_fused_feature_shared_by_tables_with_weights_equals_plain(
    weights_dtype: torch.dtype,
) -> None:
    """A weighted feature read by two tables (outputs ``a@t0``, ``a@x``): the fused forward
    and its SGD update equal the plain module's, float64 weights converted as elsewhere."""
    extra = EmbeddingBagConfig(name="x", num_embeddings=3, embedding_dim=2, feature_names=["a"])
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([*tables(), extra], is_weighted=True)
    fused = FusedEmbeddingBagCollection(
        [*tables(), extra], optimizer=FusedOptimizerConfig(name="sgd", lr=0.5), is_weighted=True
    )
    fused.load_state_dict(ebc.state_dict())
    kjt = batch(weighted=True)
    kjt = KeyedJaggedTensor.from_offsets_sync(
        kjt.keys(), kjt.values(), kjt.offsets(), weights=kjt.weights().to(weights_dtype)
    )
    expected, actual = ebc(kjt), fused(kjt)
    assert actual.keys() == ["a@t0", "b", "c", "a@x"] == expected.keys()
    torch.testing.assert_close(actual.values(), expected.values(), rtol=0, atol=1e-6)
    upstream = torch.linspace(-1, 1, expected.values().numel()).view_as(expected.values())
    (expected.values() * upstream).sum().backward()
    (actual.values() * upstream).sum().backward()
    for name, holder in ebc.embedding_bags.items():
        assert holder.weight.grad is not None and holder.weight.grad.abs().sum() > 0
        expected_weight = holder.weight.detach() - 0.5 * holder.weight.grad
        torch.testing.assert_close(fused.embedding_bags[name].weight, expected_weight)
