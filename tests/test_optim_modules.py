"""recopt.optim with recopt.modules: SparseAdam on sparse EBC gradients, fused/dense splitting,
warmup and clipping over a fused embedding collection, OptimizerStub and EmptyFusedOptimizer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    FusedOptimizerConfig,
)
from recopt.optim import (
    CombinedOptimizer,
    EmptyFusedOptimizer,
    GradientClipping,
    GradientClippingOptimizer,
    KeyedOptimizerWrapper,
    OptimizerStub,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
    fused_optimizers,
    split_fused_parameters,
)
from recopt.sparse import KeyedJaggedTensor


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=("f0",)),
        EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=8, feature_names=("f1",)),
    ]


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists({"f0": [[1, 2, 2], [9]], "f1": [[0], [3, 5]]})


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = FusedEmbeddingBagCollection(
            _tables(), optimizer=FusedOptimizerConfig(name="sgd", lr=0.1)
        )
        self.dense = nn.Linear(12, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values())


def test_sparse_adam_on_embedding_bag_collection_matches_torch() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(), sparse_grad=True)
    ref = copy.deepcopy(ebc)
    opt = KeyedOptimizerWrapper(
        dict(ebc.named_parameters()), lambda ps: torch.optim.SparseAdam(ps, lr=0.05)
    )
    opt.init_state()  # sparse zero gradients are chosen for SparseAdam
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    for module, o in ((ebc, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            module(_batch()).values().pow(2).sum().backward()
            o.step()
    for name, p in ebc.named_parameters():
        torch.testing.assert_close(p, dict(ref.named_parameters())[name])
    sd = opt.state_dict()
    assert set(sd["state"]) == {"embedding_bags.t0.weight", "embedding_bags.t1.weight"}
    assert sd["state"]["embedding_bags.t0.weight"]["step"] == 3


def test_split_fused_parameters_and_combined_optimizer_over_a_model() -> None:
    model = _Model()
    fused, other = split_fused_parameters(model)
    assert sorted(fused) == ["sparse.embedding_bags.t0.weight", "sparse.embedding_bags.t1.weight"]
    assert sorted(other) == ["dense.bias", "dense.weight"]
    found = fused_optimizers(model)
    assert [name for name, _ in found] == ["sparse"] and found[0][1] is model.sparse.fused_optimizer
    dense = KeyedOptimizerWrapper(other, lambda ps: torch.optim.Adam(ps, lr=0.01))
    combined = CombinedOptimizer([*found, dense])  # dense keys are already full names
    # Optimizer keys equal the model's parameter names.
    assert sorted(combined.params) == sorted(dict(model.named_parameters()))
    combined.init_state()
    model(_batch()).sum().backward()
    combined.step()
    sd = copy.deepcopy(combined.state_dict())
    assert sd["state"]["dense.weight"]["step"] == 1
    combined.load_state_dict(sd)


def test_warmup_lr_reaches_fused_kernel_and_clipping_leaves_it_alone() -> None:
    model = _Model()
    fused_opt = model.sparse.fused_optimizer
    warm = WarmupOptimizer(
        fused_opt, [WarmupStage(WarmupPolicy.CONSTANT, max_iters=1, value=0.0)], lr=0.1
    )
    dense = KeyedOptimizerWrapper(
        dict(model.dense.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    opt = GradientClippingOptimizer(
        CombinedOptimizer([("sparse", warm), ("dense", dense)]),
        GradientClipping.NORM,
        max_gradient=1e-3,
    )
    table = model.sparse.embedding_bags["t0"].weight
    before = table.detach().clone()
    model(_batch()).sum().backward()  # warmup LR 0 during iteration 0: no fused update
    opt.step()
    assert torch.equal(table, before)
    assert opt.last_norm is not None and float(opt.last_norm) > 1e-3  # dense grads clipped
    assert fused_opt.param_groups[0]["lr"] == 0.0  # iteration 1 is still in the stage
    opt.step()
    assert fused_opt.param_groups[0]["lr"] == pytest.approx(0.1)
    model(_batch()).sum().backward()
    assert not torch.equal(table, before)  # the kernel picked up the warmed-up LR


def test_optimizer_stub_never_touches_gradients() -> None:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    stub = OptimizerStub([p])
    grad = p.grad
    assert stub.step() is None
    assert stub.step(lambda: 5.0) == 5.0
    assert p.grad is grad and torch.all(grad == 2.0) and torch.all(p == 1.0)

    # Evolution strategies: the closure itself changes the weights, without gradients.
    def perturb() -> float:
        with torch.no_grad():
            return float(p.add_(1.0).sum())

    assert stub.step(perturb) == 6.0
    assert torch.all(p == 2.0) and torch.all(grad == 2.0)


def test_optimizer_stub_state_dict_round_trip_and_groups() -> None:
    empty = OptimizerStub()
    assert empty.param_groups == [] and empty.step() is None
    p, q = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(2))
    stub = OptimizerStub([p], lr=0.3, sigma=0.1)
    stub.add_param_group({"params": [q], "lr": 0.7})
    assert [g["lr"] for g in stub.param_groups] == [0.3, 0.7] and stub.param_groups[1][
        "sigma"
    ] == 0.1
    stub.state[p]["noise_seed"] = torch.tensor(42)
    sd = copy.deepcopy(stub.state_dict())
    other = OptimizerStub([p], lr=0.0, sigma=0.0)
    other.add_param_group({"params": [q]})
    other.load_state_dict(sd)
    assert [g["lr"] for g in other.param_groups] == [0.3, 0.7]
    assert int(other.state[p]["noise_seed"]) == 42
    with pytest.raises(ValueError):
        stub.add_param_group({"params": [p]})  # torch's own check: p is already in a group
    stub.zero_grad()


def test_empty_fused_optimizer() -> None:
    empty = EmptyFusedOptimizer()
    assert empty.params == {} and empty.param_groups == [] and empty.state_dict() == {"state": {}}
    assert empty.step(lambda: 1.5) == 1.5
    empty.init_state()
    empty.load_state_dict({"state": {}})
    empty.zero_grad()
    combined = CombinedOptimizer(
        [
            ("none", empty),
            (
                "dense",
                KeyedOptimizerWrapper(
                    {"p": nn.Parameter(torch.ones(1))}, lambda ps: torch.optim.SGD(ps, lr=1.0)
                ),
            ),
        ]
    )
    assert list(combined.params) == ["dense.p"]


class _DuckSharded(nn.Module):
    """Like a sharded twin: exposes ``fused_optimizer`` without subclassing FusedOptimizerModule."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2, 4))
        self.shared = shared
        self._opt = EmptyFusedOptimizer()

    @property
    def fused_optimizer(self) -> EmptyFusedOptimizer:
        return self._opt


def test_split_handles_duck_typed_nested_and_shared_parameters() -> None:
    shared = nn.Parameter(torch.ones(1))
    outer = _DuckSharded(shared)
    outer.inner = _DuckSharded(nn.Parameter(torch.ones(1)))  # nested: covered by the outer one
    model = nn.ModuleDict({"emb": outer, "mlp": nn.Linear(2, 2)})
    model.mlp.shared = shared  # also reachable from a dense module: counts as fused, once
    fused, other = split_fused_parameters(model)
    assert sorted(fused) == ["emb.inner.shared", "emb.inner.table", "emb.shared", "emb.table"]
    assert sorted(other) == ["mlp.bias", "mlp.weight"]
    assert [name for name, _ in fused_optimizers(model)] == ["emb"]
    whole = _DuckSharded(nn.Parameter(torch.ones(1)))
    assert [name for name, _ in fused_optimizers(whole)] == [""]


def _fused_with_groups(name: str, **options: Any) -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    config = FusedOptimizerConfig(name=name, lr=0.1, backend="recopt", **options)
    ebc = FusedEmbeddingBagCollection(_tables(), optimizer=config)
    ebc.fused_optimizer.save_param_groups(True)
    return ebc


def test_fused_param_groups_load_lr_and_refuse_what_the_kernel_fixed() -> None:
    """With param groups saved, a fused optimizer loads ``lr`` (the kernel reads it) and keeps
    its own backend fields; a different optimizer or weight decay is refused, nothing
    changed (it used to be copied into the group and shown, but not applied)."""
    source = _fused_with_groups("adam", weight_decay=0.5)
    saved = copy.deepcopy(source.fused_optimizer.state_dict())
    saved["param_groups"][0]["lr"] = 0.03
    saved["param_groups"][0]["backend_reason"] = "another machine's"
    same = _fused_with_groups("adam", weight_decay=0.5)
    same.fused_optimizer.load_state_dict(saved)
    group = same.fused_optimizer.param_groups[0]
    assert group["lr"] == 0.03 and group["backend_reason"] != "another machine's"
    for name, options, key in [
        ("adam", {}, "weight_decay"),
        ("lamb", {"weight_decay": 0.5}, "optimizer"),
    ]:
        other = _fused_with_groups(name, **options)
        before = copy.deepcopy(other.fused_optimizer.state_dict())
        with pytest.raises(
            ValueError, match=rf"param group 0: '{key}' is .* built into its kernel"
        ):
            other.fused_optimizer.load_state_dict(saved)
        after = other.fused_optimizer.state_dict()
        assert after["param_groups"] == before["param_groups"]
