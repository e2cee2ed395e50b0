"""CombinedOptimizer: key prefixing, live views, loading into children, errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from recopt.optim import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper


def _child(seed: int, lr: float = 0.1) -> tuple[KeyedOptimizerWrapper, dict[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": nn.Parameter(torch.randn(3, 2, generator=g)),
        "b": nn.Parameter(torch.randn(2, generator=g)),
    }
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adam(ps, lr=lr)), params


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    opt.zero_grad()
    sum((p**2).sum() for p in params).backward()
    opt.step()


def test_prefixing_and_views() -> None:
    dense, dp = _child(0)
    sparse, sp = _child(1)
    unnamed, up = _child(2)
    unnamed_params = {"u": up["w"]}
    solo = KeyedOptimizerWrapper(
        unnamed_params, lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9)
    )
    combined = CombinedOptimizer([("dense", dense), ("sparse", sparse), solo])
    assert list(combined.params) == ["dense.w", "dense.b", "sparse.w", "sparse.b", "u"]
    assert combined.params["sparse.b"] is sp["b"]
    assert [n for n, _ in combined.optimizers] == ["dense", "sparse", ""]
    # param_groups are the children's own dicts: a write reaches the child.
    combined.param_groups[1]["lr"] = 0.01
    assert sparse.param_groups[0]["lr"] == 0.01
    _step(combined, [*dp.values(), *sp.values(), up["w"]])
    assert len(combined.state) == 5
    assert combined.state[dp["w"]] is dense.state[dp["w"]]
    replacement = {"exp_avg": torch.zeros(1)}
    combined.state[sp["b"]] = replacement  # writes reach the owning child
    assert sparse.state[sp["b"]] is replacement
    sd = combined.state_dict()
    assert list(sd["state"]) == ["dense.w", "dense.b", "sparse.w", "sparse.b", "u"]


def test_state_dict_round_trip_loads_into_children() -> None:
    a, ap = _child(0)
    b, bp = _child(1)
    combined = CombinedOptimizer([("a", a), ("b", b)])
    combined.save_param_groups(True)
    for _ in range(2):
        _step(combined, [*ap.values(), *bp.values()])
    sd = copy.deepcopy(combined.state_dict())
    assert [g["params"] for g in sd["param_groups"]] == [["a.w", "a.b"], ["b.w", "b.b"]]

    a2, ap2 = _child(0)
    b2, bp2 = _child(1)
    fresh = CombinedOptimizer([("a", a2), ("b", b2)])
    fresh.save_param_groups(True)
    loads: list[str] = []
    b2.register_load_state_dict_post_hook(lambda opt: loads.append("b"))
    fresh.init_state()
    sd["param_groups"][1]["lr"] = 0.25
    fresh.load_state_dict(sd)
    assert loads == ["b"]  # each child's own load (and its hooks) ran
    assert b2.param_groups[0]["lr"] == 0.25
    torch.testing.assert_close(b2.state[bp2["w"]]["exp_avg"], b.state[bp["w"]]["exp_avg"])
    torch.testing.assert_close(a2.state[ap2["b"]]["step"], torch.tensor(2.0))


def test_load_is_all_or_nothing_across_children() -> None:
    a, ap = _child(0)
    b, bp = _child(1)
    combined = CombinedOptimizer([("a", a), ("b", b)])
    _step(combined, [*ap.values(), *bp.values()])
    sd = copy.deepcopy(combined.state_dict())
    sd["state"]["a.w"]["exp_avg"].fill_(9.0)  # a valid change in the first child
    sd["state"]["b.w"]["exp_avg"] = torch.zeros(5)  # a bad one in the second
    with pytest.raises(ValueError, match=r"parameter 'w'.exp_avg: shape \(5,\)"):
        combined.load_state_dict(sd)
    assert not torch.any(a.state[ap["w"]]["exp_avg"] == 9.0)


def test_step_evaluates_closure_once_and_zero_grad_reaches_children() -> None:
    a, ap = _child(0)
    b, bp = _child(1)
    combined = CombinedOptimizer([("a", a), ("b", b)])
    calls: list[int] = []

    def closure() -> float:
        calls.append(1)
        loss = sum((p**2).sum() for p in [*ap.values(), *bp.values()])
        loss.backward()
        return float(loss.detach())

    before = ap["w"].detach().clone()
    loss = combined.step(closure)
    assert calls == [1] and isinstance(loss, float)
    assert not torch.equal(before, ap["w"])
    combined.zero_grad()
    assert all(p.grad is None for p in [*ap.values(), *bp.values()])


def test_sparse_names_route_to_children() -> None:
    emb = nn.Embedding(5, 2, sparse=True)
    child = KeyedOptimizerWrapper({"weight": emb.weight}, lambda ps: torch.optim.SparseAdam(ps))
    combined = CombinedOptimizer([("emb", child)])
    combined.init_state({"emb.weight"})
    assert emb.weight in child.state
    with pytest.raises(
        ValueError, match=r"sparse_grad_parameter_names: 'weight' is not a parameter"
    ):
        combined.init_state({"weight"})


def test_init_state_without_names_lets_each_child_find_its_sparse_ones() -> None:
    """``init_state()`` with no names: a SparseAdam child makes its zero gradients sparse, as
    it does alone (under a CombinedOptimizer it used to get dense ones and raise)."""
    emb = nn.Embedding(5, 2, sparse=True)
    dense = nn.Parameter(torch.ones(3))
    combined = CombinedOptimizer(
        [
            ("emb", KeyedOptimizerWrapper({"weight": emb.weight}, torch.optim.SparseAdam)),
            ("dense", KeyedOptimizerWrapper({"w": dense}, torch.optim.Adam)),
        ]
    )
    combined.init_state()
    assert emb.weight in combined.state and dense in combined.state
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse


def test_a_failed_init_state_leaves_the_gradients_as_they_were() -> None:
    """A child whose zero step raises (SparseAdam given dense zero gradients by name) leaves
    no gradient behind (it used to leave a dense zero one)."""
    emb = nn.Embedding(5, 2, sparse=True)
    child = KeyedOptimizerWrapper({"weight": emb.weight}, torch.optim.SparseAdam)
    with pytest.raises(RuntimeError, match="dense gradients"):
        child.init_state([])  # (no name sparse: dense zero gradients)
    assert emb.weight.grad is None and emb.weight not in child.state


def test_errors() -> None:
    a, _ = _child(0)
    b, _ = _child(1)
    with pytest.raises(ValueError, match=r"key 'w' comes from two children"):
        CombinedOptimizer([a, b])
    with pytest.raises(ValueError, match=r"child name 'x' is used twice"):
        CombinedOptimizer([("x", a), ("x", b)])
    with pytest.raises(ValueError, match=r"optims\[1\] is a SGD, not a KeyedOptimizer"):
        CombinedOptimizer([a, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)])  # type: ignore[list-item]
    combined = CombinedOptimizer([("a", a), ("b", b)])
    combined.init_state()
    sd: dict[str, Any] = copy.deepcopy(combined.state_dict())
    sd["state"]["c.w"] = {}
    with pytest.raises(ValueError, match=r"unknown key 'c.w'"):
        combined.load_state_dict(sd)
    sd = copy.deepcopy(combined.state_dict())
    sd["param_groups"] = [{"params": ["a.w", "b.w"], "lr": 1.0}]
    with pytest.raises(ValueError, match=r"does not belong to exactly one child"):
        combined.load_state_dict(sd)
    with pytest.raises(NotImplementedError, match=r"cannot add param groups"):
        combined.add_param_group({"params": []})
    with pytest.raises(AttributeError, match=r"is a view"):
        combined.params = {}


def test_nested_combined_and_keyed_base() -> None:
    a, ap = _child(0)
    inner = CombinedOptimizer([("a", a)])
    outer = CombinedOptimizer([("outer", inner)])
    _step(outer, list(ap.values()))
    assert list(outer.state_dict()["state"]) == ["outer.a.w", "outer.a.b"]
    assert isinstance(outer, KeyedOptimizer)
    sd = copy.deepcopy(outer.state_dict())
    sd["state"]["outer.a.w"]["exp_avg"].fill_(3.0)
    outer.load_state_dict(sd)
    assert torch.all(a.state[ap["w"]]["exp_avg"] == 3.0)


def test_defaults_merge_the_childrens_so_momentum_schedulers_work() -> None:
    """OneCycleLR and CyclicLR (momentum cycling on, their default) read ``momentum`` or
    ``betas`` from the optimizer's defaults: a combined optimizer of momentum SGD children
    now gives them (its defaults were empty, and both refused it)."""
    a = nn.Parameter(torch.ones(2))
    b = nn.Parameter(torch.ones(3))
    sgd = KeyedOptimizerWrapper({"a": a}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    other = KeyedOptimizerWrapper({"b": b}, lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5))
    combined = CombinedOptimizer([("x", sgd), ("y", other)])
    assert combined.defaults["momentum"] == 0.9  # the first child's, where several have it
    with pytest.raises(AttributeError, match="no defaults of its own"):
        combined.defaults = {}
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(combined, max_lr=1.0, total_steps=10)
    cyclic = torch.optim.lr_scheduler.CyclicLR(combined, base_lr=0.01, max_lr=0.1)
    for scheduler in (one_cycle, cyclic):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        combined.step()
        scheduler.step()
    assert all(g["momentum"] < 0.95 for g in combined.param_groups)  # cycled in every child
