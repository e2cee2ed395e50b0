"""EmbeddingCollection and FusedEmbeddingCollection against plain torch references."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.fbgemm_backend import FBGEMM_OPTIMIZERS
from recopt.kernels.registry import OPTIMIZERS
from recopt.modules import (
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    InvalidIdError,
)
from recopt.sparse import JaggedTensor, KeyedJaggedTensor

FBGEMM, RECOPT = Backend.FBGEMM, Backend.RECOPT


def tables(shared: bool = True) -> list[EmbeddingConfig]:
    """t0 serves features a and b (shared) or b has its own table t0b; t1 (dim 8) serves c."""
    first = [
        EmbeddingConfig(
            name="t0",
            num_embeddings=10,
            embedding_dim=4,
            feature_names=["a", "b"] if shared else ["a"],
        )
    ]
    if not shared:
        first.append(
            EmbeddingConfig(name="t0b", num_embeddings=10, embedding_dim=4, feature_names=["b"])
        )
    return [
        *first,
        EmbeddingConfig(name="t1", num_embeddings=6, embedding_dim=8, feature_names=["c"]),
    ]


def batch(generator: torch.Generator | None = None) -> KeyedJaggedTensor:
    """Features with different id counts; ids repeat within and across features."""
    if generator is None:
        ids = {"a": [[1, 1, 2], [2]], "b": [[2], []], "c": [[0, 5], [5], []]}
        return KeyedJaggedTensor.from_id_lists({k: v[:2] for k, v in ids.items()})
    lengths = torch.randint(0, 4, (3, 2), generator=generator)
    lengths[2, 0] = max(int(lengths[2, 0]), 1)  # every table sees an id (SparseAdam's step)
    lengths[0, 0] = max(int(lengths[0, 0]), 1)
    lengths[1, 0] = max(int(lengths[1, 0]), 1)
    rows = [10, 10, 6]
    values = [
        torch.randint(0, rows[f], (int(lengths[f].sum()),), generator=generator) for f in range(3)
    ]
    return KeyedJaggedTensor(["a", "b", "c"], torch.cat(values), lengths=lengths.reshape(-1))


def reference_lookup(
    weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor, owner: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Each feature's rows by torch.nn.functional.embedding."""
    return {f: functional.embedding(kjt[f].values(), weights[owner[f]]) for f in ("a", "b", "c")}


def owners(shared: bool) -> dict[str, str]:
    return {"a": "t0", "b": "t0" if shared else "t0b", "c": "t1"}


def make_pair(
    optimizer: FusedOptimizerConfig, shared: bool = True, sparse: bool = False
) -> tuple[EmbeddingCollection, FusedEmbeddingCollection]:
    torch.manual_seed(0)
    plain = EmbeddingCollection(tables(shared), sparse_grad=sparse)
    torch.manual_seed(0)
    fused = FusedEmbeddingCollection(tables(shared), optimizer=optimizer)
    return plain, fused


@pytest.mark.parametrize("need_indices", [False, True])
def test_forward_equals_functional_embedding(need_indices: bool) -> None:
    torch.manual_seed(0)
    plain = EmbeddingCollection(tables(), need_indices=need_indices)
    torch.manual_seed(0)
    fused = FusedEmbeddingCollection(tables(), need_indices=need_indices)
    kjt = batch()
    weights = {n: e.weight.detach() for n, e in plain.embeddings.items()}
    expected = reference_lookup(weights, kjt, owners(True))
    for out in (plain(kjt), fused(kjt)):
        assert list(out) == ["a", "b", "c"]
        for f, rows in expected.items():
            assert isinstance(out[f], JaggedTensor)
            assert torch.equal(out[f].values(), rows)
            assert torch.equal(out[f].lengths(), kjt[f].lengths())
            if need_indices:
                assert torch.equal(out[f].weights(), kjt[f].values())
            else:
                assert out[f].weights_or_none() is None
    assert out["a"].values().shape == (4, 4) and out["c"].values().shape == (3, 8)
    assert (
        sorted(plain.state_dict())
        == sorted(fused.state_dict())
        == ["embeddings.t0.weight", "embeddings.t1.weight"]
    )
    assert list(fused.fused_optimizer.params) == ["embeddings.t0.weight", "embeddings.t1.weight"]


def test_gradients_equal_functional_embedding() -> None:
    plain = EmbeddingCollection(tables())
    kjt = batch()
    leaves = {
        n: e.weight.detach().clone().requires_grad_(True) for n, e in plain.embeddings.items()
    }
    upstream = {
        f: torch.randn(kjt[f].values().numel(), d) for f, d in (("a", 4), ("b", 4), ("c", 8))
    }
    out = plain(kjt)
    sum((out[f].values() * upstream[f]).sum() for f in upstream).backward()
    ref = reference_lookup(leaves, kjt, owners(True))
    sum((ref[f] * upstream[f]).sum() for f in upstream).backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(plain.embeddings[name].weight.grad, leaf.grad)
    sparse = EmbeddingCollection(tables(), sparse_grad=True)
    sparse(kjt)["a"].values().sum().backward()
    assert sparse.embeddings["t0"].weight.grad.is_sparse


def torch_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=1e-8)
    return torch.optim.SparseAdam(params, lr=lr, betas=(0.8, 0.99), eps=1e-7)


CASES = [
    ("sgd", FBGEMM),
    ("sgd", RECOPT),
    ("adagrad", FBGEMM),
    ("adagrad", RECOPT),
    ("adam", RECOPT),
]
CASES += [("adam", FBGEMM)] if "adam" in FBGEMM_OPTIMIZERS else []


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_fused_steps_equal_torch_optim(name: str, backend: Backend) -> None:
    lr = 0.05
    extra = (
        {"betas": (0.8, 0.99), "eps": 1e-7}
        if name == "adam"
        else {"eps": 1e-8}
        if name == "adagrad"
        else {}
    )
    shared = backend == RECOPT or name == "sgd"  # fbgemm's CPU adagrad refuses a shared table
    plain, fused = make_pair(
        FusedOptimizerConfig(name=name, lr=lr, backend=backend, **extra),
        shared,
        sparse=name == "adam",
    )
    reference = torch_optimizer(name, list(plain.parameters()), lr)
    generator = torch.Generator().manual_seed(1)
    dims = {"a": 4, "b": 4, "c": 8}
    for _ in range(4):
        kjt = batch(generator)
        upstream = {
            f: torch.randn(kjt[f].values().numel(), d, generator=generator) for f, d in dims.items()
        }
        reference.zero_grad()
        out = plain(kjt)
        sum((out[f].values() * upstream[f]).sum() for f in dims).backward()
        reference.step()
        out = fused(kjt)
        sum((out[f].values() * upstream[f]).sum() for f in dims).backward()
    state = fused.fused_optimizer.state_dict()["state"]
    for table, embedding in plain.embeddings.items():
        key = f"embeddings.{table}.weight"
        torch.testing.assert_close(
            fused.embeddings[table].weight, embedding.weight.detach(), atol=1e-5, rtol=1e-5
        )
        ref_state = reference.state[embedding.weight]
        pairs = {
            "adagrad": [("momentum1", "sum")],
            "adam": [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")],
        }
        for ours, theirs in pairs.get(name, []):
            torch.testing.assert_close(
                state[key][f"{table}.{ours}"], ref_state[theirs], atol=1e-5, rtol=1e-5
            )


def one_id_bags_by_hand(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """Each id its own bag, every feature padded with empty bags to the longest feature."""
    ids = {f: kjt[f].values().tolist() for f in kjt.keys()}
    stride = max(1, *(len(v) for v in ids.values()))
    return KeyedJaggedTensor.from_id_lists(
        {f: [[i] for i in v] + [[]] * (stride - len(v)) for f, v in ids.items()}
    )


REGISTRY_CASES = [(name, RECOPT) for name in OPTIMIZERS] + [
    (name, FBGEMM) for name in sorted(FBGEMM_OPTIMIZERS)
]


@pytest.mark.parametrize(("name", "backend"), REGISTRY_CASES)
def test_every_registry_optimizer_equals_one_id_bags(name: str, backend: Backend) -> None:
    """The fused EC trains like a fused EBC fed one id per bag (the design it is built on)."""
    config = FusedOptimizerConfig(name=name, backend=backend)
    shared = backend == RECOPT or name == "sgd"
    torch.manual_seed(0)
    fused = FusedEmbeddingCollection(tables(shared), optimizer=config)
    bag_tables = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=t.feature_names,
        )
        for t in tables(shared)
    ]
    torch.manual_seed(0)
    bags = FusedEmbeddingBagCollection(bag_tables, optimizer=config)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        kjt = batch(generator)
        out = fused(kjt)
        loss = sum((out[f].values() ** 2).sum() * (i + 1) for i, f in enumerate("abc"))
        loss.backward()
        pooled = bags(one_id_bags_by_hand(kjt))
        counts = {f: kjt[f].values().numel() for f in "abc"}
        loss = sum((pooled[f][: counts[f]] ** 2).sum() * (i + 1) for i, f in enumerate("abc"))
        loss.backward()
    for table in fused.embeddings:
        torch.testing.assert_close(
            fused.embeddings[table].weight, bags.embedding_bags[table].weight
        )
    ours = fused.fused_optimizer.state_dict()["state"]
    theirs = bags.fused_optimizer.state_dict()["state"]
    for table in fused.embeddings:
        for key, value in theirs[f"embedding_bags.{table}.weight"].items():
            torch.testing.assert_close(ours[f"embeddings.{table}.weight"][key], value)


@pytest.mark.parametrize("bad_id", [10, -1])
def test_out_of_range_ids_raise_and_update_nothing(bad_id: int) -> None:
    plain, fused = make_pair(FusedOptimizerConfig(name="sgd"))
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    kjt = KeyedJaggedTensor.from_id_lists({"a": [[1], [2]], "b": [[bad_id], []], "c": [[0], [5]]})
    for module in (plain, fused):
        with pytest.raises(InvalidIdError, match=rf"table 't0', feature 'b': id {bad_id} is out"):
            module(kjt)
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key])


def test_empty_features_and_empty_input() -> None:
    plain, fused = make_pair(FusedOptimizerConfig(name="sgd", lr=0.1))
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    one_empty = KeyedJaggedTensor.from_id_lists({"a": [[], []], "b": [[3], [4, 4]], "c": [[], []]})
    nothing = KeyedJaggedTensor.from_id_lists({"a": [[]], "b": [[]], "c": [[]]})
    for module in (plain, fused):
        out = module(one_empty)
        assert out["a"].values().shape == (0, 4) and out["c"].values().shape == (0, 8)
        assert out["b"].values().shape == (3, 4)
        assert torch.equal(out["a"].lengths(), torch.tensor([0, 0]))
        empty = module(nothing)
        assert all(empty[f].values().shape[0] == 0 for f in "abc")
    out = fused(one_empty)
    sum(o.values().sum() for o in out.values()).backward()
    after = fused.state_dict()
    assert torch.equal(after["embeddings.t1.weight"], before["embeddings.t1.weight"])
    changed = (after["embeddings.t0.weight"] != before["embeddings.t0.weight"]).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [3, 4]


def test_input_order_extra_keys_and_missing_features() -> None:
    plain, fused = make_pair(FusedOptimizerConfig(name="sgd"))
    ids = {"c": [[0, 5], [5]], "x": [[7], [7]], "b": [[2], []], "a": [[1, 1, 2], [2]]}
    shuffled = KeyedJaggedTensor.from_id_lists(ids)
    for module in (plain, fused):
        out, ref = module(shuffled), module(batch())
        assert list(out) == ["a", "b", "c"]
        assert all(torch.equal(out[f].values(), ref[f].values()) for f in "abc")
        with pytest.raises(ValueError, match=r"missing features \['c'\]"):
            module(KeyedJaggedTensor.from_id_lists({"a": [[1]], "b": [[2]]}))


def test_configs_validate_and_modules_check_their_config_type() -> None:
    with pytest.raises(ValueError, match="embedding_dim must be an int >= 1"):
        EmbeddingConfig(name="t", num_embeddings=4, embedding_dim=0, feature_names=["f"])
    with pytest.raises(ValueError, match="feature_names is empty"):
        EmbeddingConfig(name="t", num_embeddings=4, embedding_dim=4)
    assert not hasattr(
        EmbeddingConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"]), "pooling"
    )
    bag = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"])
    for cls in (EmbeddingCollection, FusedEmbeddingCollection):
        with pytest.raises(
            ValueError, match="expected EmbeddingConfig tables, got EmbeddingBagConfig 't'"
        ):
            cls([bag])
    plain = EmbeddingCollection(tables())
    with pytest.raises(ValueError, match=r"different embedding_dim \[4, 8\]"):
        plain.embedding_dim()
    assert EmbeddingCollection(tables()[:1]).embedding_dim() == 4
    assert plain.embedding_configs() == tables() and not plain.need_indices()


def test_meta_device_gives_shapes_only() -> None:
    for module in (
        EmbeddingCollection(tables(), device="meta"),
        FusedEmbeddingCollection(tables(), device="meta"),
    ):
        out = module(batch())
        assert out["a"].values().shape == (4, 4) and out["a"].values().device.type == "meta"
        assert out["c"].values().shape == (3, 8)


@pytest.mark.parametrize("backend", [FBGEMM, RECOPT])
def test_state_load_and_deepcopy_reach_the_kernel(backend: Backend) -> None:
    plain, fused = make_pair(FusedOptimizerConfig(name="sgd", lr=0.5, backend=backend))
    with torch.no_grad():
        for e in plain.embeddings.values():
            e.weight.mul_(3.0)
    fused.load_state_dict(plain.state_dict())
    kjt = batch()
    out = fused(kjt)
    assert torch.equal(out["c"].values(), plain(kjt)["c"].values())
    twin = copy.deepcopy(fused)
    twin_out = twin(kjt)
    twin_out["a"].values().sum().backward()
    assert not torch.equal(twin.embeddings["t0"].weight, fused.embeddings["t0"].weight)
    assert torch.equal(fused.embeddings["t0"].weight, plain.embeddings["t0"].weight.detach())
    assert (
        twin.embeddings["t0"].weight.data_ptr()
        == twin.kernels()[0].split_embedding_weights()[0].data_ptr()
    )


def test_variable_batch_per_feature() -> None:
    """Only each feature's id count matters: features may have different batch sizes."""
    plain, fused = make_pair(FusedOptimizerConfig(name="sgd"))
    kjt = KeyedJaggedTensor.from_jt_dict(
        {
            "c": JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2])),
            "a": JaggedTensor(torch.tensor([4, 5, 6, 7]), lengths=torch.tensor([1, 1, 2])),
            "b": JaggedTensor(torch.tensor([9]), lengths=torch.tensor([1])),
        }
    )
    assert kjt.variable_stride_per_key()
    weights = {n: e.weight.detach() for n, e in plain.embeddings.items()}
    expected = reference_lookup(weights, kjt, owners(True))
    for out in (plain(kjt), fused(kjt)):
        for f, rows in expected.items():
            assert torch.equal(out[f].values(), rows)
            assert torch.equal(out[f].lengths(), kjt[f].lengths())


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adagrad", "adam", "row_wise_adam"])
def test_cuda_equals_cpu_after_several_steps(name: str) -> None:
    gpu = torch.device("cuda", 0)
    modules = []
    for device in (gpu, torch.device("cpu")):
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name=name, lr=0.05, backend=Backend.AUTO)
        modules.append(
            FusedEmbeddingCollection(tables(shared=False), optimizer=config, device=device)
        )
    on_gpu, on_cpu = modules
    on_gpu.load_state_dict(on_cpu.state_dict())
    plain = EmbeddingCollection(tables(shared=False), device=gpu)
    plain.load_state_dict(on_cpu.state_dict())
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        kjt = batch(generator)
        if step == 0:  # the plain module on the GPU looks up the same rows
            out = plain(kjt.to(gpu))
            assert all(torch.equal(out[f].values().cpu(), on_cpu(kjt)[f].values()) for f in "abc")
        for module in (on_gpu, on_cpu):
            out = module(kjt.to(module.device))
            loss = sum((out[f].values() ** 2).sum() * (i + 1) for i, f in enumerate("abc"))
            loss.backward()
    for key, value in on_cpu.state_dict().items():
        torch.testing.assert_close(on_gpu.state_dict()[key].cpu(), value, atol=1e-6, rtol=1e-5)
    mine = on_gpu.fused_optimizer.state_dict()["state"]
    for param, states in on_cpu.fused_optimizer.state_dict()["state"].items():
        for state_name, value in states.items():
            got = torch.as_tensor(mine[param][state_name]).cpu()
            torch.testing.assert_close(got, torch.as_tensor(value), atol=1e-5, rtol=1e-4)


def test_a_feature_shared_by_tables_gives_one_output_per_table() -> None:
    """As TorchRec's EmbeddingCollection: outputs ``feature@table``; the fused module gives the
    same rows and its SGD update equals the plain module's gradient step."""
    extra = EmbeddingConfig(name="x", num_embeddings=3, embedding_dim=2, feature_names=["a"])
    torch.manual_seed(0)
    plain = EmbeddingCollection([*tables(), extra], need_indices=True)
    sgd = FusedOptimizerConfig(name="sgd", lr=0.5)
    fused = FusedEmbeddingCollection([*tables(), extra], sgd, need_indices=True)
    fused.load_state_dict(plain.state_dict())
    assert fused.feature_names() == plain.feature_names() == ["a", "b", "c", "a"]
    kjt = KeyedJaggedTensor.from_id_lists({"a": [[0, 1], [2]], "b": [[], [5]], "c": [[4], []]})
    out, fused_out = plain(kjt), fused(kjt)
    assert list(out) == list(fused_out) == ["a@t0", "b", "c", "a@x"]
    assert torch.equal(out["a@x"].values(), plain.embeddings["x"].weight[[0, 1, 2]])
    assert torch.equal(out["a@t0"].values(), plain.embeddings["t0"].weight[[0, 1, 2]])
    assert torch.equal(out["a@x"].weights(), torch.tensor([0, 1, 2]))
    loss = sum(((k + 1) * jt.values()).square().sum() for k, jt in enumerate(out.values()))
    fused_loss = sum(
        ((k + 1) * jt.values()).square().sum() for k, jt in enumerate(fused_out.values())
    )
    for key, jt in out.items():
        assert torch.equal(fused_out[key].weights(), jt.weights())
        torch.testing.assert_close(fused_out[key].values(), jt.values())
    loss.backward()
    fused_loss.backward()
    for name, embedding in plain.embeddings.items():
        assert embedding.weight.grad is not None
        expected = embedding.weight.detach() - 0.5 * embedding.weight.grad
        torch.testing.assert_close(fused.embeddings[name].weight, expected)
    bad = KeyedJaggedTensor.from_id_lists({"a": [[3]], "b": [[]], "c": [[]]})
    with pytest.raises(InvalidIdError, match="table 'x', feature 'a': id 3"):
        plain(bad)
    with pytest.raises(InvalidIdError, match="table 'x', feature 'a@x': id 3"):
        fused(bad)


def test_bag_view_of_a_table_keeps_every_field_and_init_fn_applies() -> None:
    import dataclasses

    from recopt.modules import BaseEmbeddingConfig, PoolingType

    def init(weight: torch.Tensor) -> None:
        weight.fill_(0.5)

    table = EmbeddingConfig(
        name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"], init_fn=init
    )
    bag = table.as_bag_config()
    for f in dataclasses.fields(BaseEmbeddingConfig):
        assert getattr(bag, f.name) == getattr(table, f.name), f.name
    assert bag.pooling == PoolingType.SUM
    for module in (EmbeddingCollection([table]), FusedEmbeddingCollection([table])):
        assert torch.equal(module.embeddings["t"].weight, torch.full((4, 4), 0.5))
