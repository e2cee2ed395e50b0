"""KeyedOptimizer and KeyedOptimizerWrapper: keyed state_dict, strict in-place loads, init_state."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recopt.optim import KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper


class DummyKeyed(KeyedOptimizer):
    """A KeyedOptimizer with eagerly given state and a no-op step."""

    def step(self, closure: Any = None) -> None:
        return None


def _params(seed: int = 0) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": nn.Parameter(torch.randn(4, 3, generator=g)),
        "b": nn.Parameter(torch.randn(3, generator=g)),
    }


def _adam(params: dict[str, nn.Parameter], **kw: Any) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adam(ps, lr=0.1, **kw))


def _train(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], steps: int = 3) -> None:
    for i in range(steps):
        opt.zero_grad()
        loss = sum(((p - i) ** 2).sum() for p in params.values())
        loss.backward()
        opt.step()


# ------------------------------------------------------------------ state_dict round trip
def test_state_dict_is_keyed_by_name_and_matches_torch() -> None:
    params = _params()
    opt = _adam(params)
    _train(opt, params)
    sd = opt.state_dict()
    assert set(sd) == {"state"}  # param groups only on request
    assert set(sd["state"]) == {"w", "b"}
    assert set(sd["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    # Same numbers as a plain torch Adam trained identically.
    ref_params = _params()
    ref = torch.optim.Adam(ref_params.values(), lr=0.1)
    _train(ref, ref_params)
    torch.testing.assert_close(sd["state"]["w"]["exp_avg"], ref.state[ref_params["w"]]["exp_avg"])
    torch.testing.assert_close(params["w"], ref_params["w"])


@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.Adafactor(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    ],
    ids=["adam", "adafactor", "adagrad"],
)
def test_round_trip_into_fresh_optimizer_continues_like_uninterrupted(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> None:
    params = _params()
    opt = KeyedOptimizerWrapper(params, factory)
    _train(opt, params, steps=2)
    sd = copy.deepcopy(opt.state_dict())
    weights = {k: p.detach().clone() for k, p in params.items()}

    resumed_params = {k: nn.Parameter(w.clone()) for k, w in weights.items()}
    resumed = KeyedOptimizerWrapper(resumed_params, factory)
    resumed.init_state()
    resumed.load_state_dict(sd)
    _train(opt, params, steps=2)
    _train(resumed, resumed_params, steps=2)
    for k in params:
        torch.testing.assert_close(resumed_params[k], params[k], rtol=0, atol=0)


def test_load_copies_in_place_and_state_dict_aliases_live_tensors() -> None:
    params = _params()
    opt = _adam(params)
    _train(opt, params)
    live = opt.state[params["w"]]["exp_avg"]
    assert opt.state_dict()["state"]["w"]["exp_avg"] is live
    sd = copy.deepcopy(opt.state_dict())
    sd["state"]["w"]["exp_avg"].fill_(7.0)
    opt.load_state_dict(sd)
    assert opt.state[params["w"]]["exp_avg"] is live  # same tensor object, new contents
    assert torch.all(live == 7.0)


def test_nested_state_round_trip_and_python_scalars_replaced() -> None:
    p = nn.Parameter(torch.zeros(2))
    state = {
        p: {
            "buf": [torch.ones(2), {"inner": torch.zeros(3)}],
            "count": 1,
            "pair": (torch.ones(1), 2),
        }
    }
    opt = DummyKeyed({"p": p}, state, [{"params": [p], "lr": 1.0}])
    new = {
        "state": {
            "p": {
                "buf": [torch.full((2,), 3.0), {"inner": torch.full((3,), 4.0)}],
                "count": 9,
                "pair": (torch.full((1,), 5.0), 6),
            }
        }
    }
    buf0 = state[p]["buf"][0]
    opt.load_state_dict(new)
    assert buf0 is opt.state[p]["buf"][0] and torch.all(buf0 == 3.0)
    assert torch.all(opt.state[p]["buf"][1]["inner"] == 4.0)
    assert opt.state[p]["count"] == 9
    assert torch.all(opt.state[p]["pair"][0] == 5.0) and opt.state[p]["pair"][1] == 6
    out = opt.state_dict()["state"]["p"]
    assert out["count"] == 9 and torch.all(out["buf"][1]["inner"] == 4.0)


def test_param_groups_saved_by_name_and_loaded() -> None:
    params = _params()
    opt = _adam(params)
    opt.save_param_groups(True)
    _train(opt, params, steps=1)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["param_groups"][0]["params"] == ["w", "b"]
    sd["param_groups"][0]["lr"] = 0.5
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.5
    # Without the flag, groups in a state dict are ignored (as in the reference).
    opt.save_param_groups(False)
    sd["param_groups"][0]["lr"] = 0.25
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.5


def test_pickle_round_trip_keeps_state_and_sharing() -> None:
    params = _params()
    opt = _adam(params)
    _train(opt, params)
    opt.register_step_pre_hook(lambda *a: None)  # a lambda hook is dropped, not fatal
    clone = pickle.loads(pickle.dumps(opt))
    w = clone.params["w"]
    torch.testing.assert_close(clone.state[w]["exp_avg"], opt.state[params["w"]]["exp_avg"])
    assert clone.state is clone._optimizer.state  # still the wrapped optimizer's own state
    assert clone.param_groups is clone._optimizer.param_groups
    # A restored optimizer still steps and still runs hooks registered after loading.
    calls: list[str] = []
    clone.register_step_post_hook(lambda *a: calls.append("post"))
    before = w.detach().clone()
    w.grad = torch.ones_like(w)
    clone.step()
    assert calls == ["post"] and not torch.equal(before, w)


# ------------------------------------------------------------------ strict loading errors
def _initialised() -> tuple[KeyedOptimizerWrapper, dict[str, nn.Parameter], dict[str, Any]]:
    params = _params()
    opt = _adam(params)
    _train(opt, params, steps=1)
    return opt, params, copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda sd: sd["state"]["w"].pop("exp_avg"),
            r"parameter 'w': state keys differ .*'exp_avg'",
        ),
        (
            lambda sd: sd["state"]["w"].__setitem__("extra", 1),
            r"parameter 'w': state keys differ .*'extra'",
        ),
        (
            lambda sd: sd["state"]["w"].__setitem__("exp_avg", torch.zeros(3, 4)),
            r"parameter 'w'.exp_avg: shape \(3, 4\) .* \(4, 3\)",
        ),
        (
            lambda sd: sd["state"]["w"].__setitem__("exp_avg", torch.zeros(1)),
            r"parameter 'w'.exp_avg: shape \(1,\)",
        ),
        (
            lambda sd: sd["state"]["b"].__setitem__("exp_avg", torch.zeros(3, dtype=torch.float64)),
            r"parameter 'b'.exp_avg: dtype torch.float64 .* torch.float32",
        ),
        (
            lambda sd: sd["state"]["b"].__setitem__("step", 3),
            r"parameter 'b'.step: the optimizer holds a tensor but the state_dict has a python",
        ),
        (lambda sd: sd["state"].pop("b"), r"no state for parameters 'b'"),
        (lambda sd: sd["state"].__setitem__("ghost", {}), r"unknown parameters 'ghost'"),
        (
            lambda sd: sd["state"].clear(),
            r"state_dict\['state'\] is empty but this optimizer is initialised",
        ),
        (lambda sd: sd.pop("state"), r"mapping with a 'state' entry"),
        (lambda sd: sd.__setitem__("extras", 1), r"unknown top-level keys 'extras'"),
    ],
)
def test_bad_state_dict_is_refused_and_nothing_changes(
    mutate: Callable[[dict[str, Any]], Any], match: str
) -> None:
    opt, params, sd = _initialised()
    before = copy.deepcopy(opt.state_dict())
    # A valid change to the *other* parameter shows the load is all-or-nothing.
    if "b" in sd["state"] and "exp_avg_sq" in sd["state"]["b"]:
        sd["state"]["b"]["exp_avg_sq"] = sd["state"]["b"]["exp_avg_sq"] + 1
    mutate(sd)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for name in ("w", "b"):
        for key, value in before["state"][name].items():
            torch.testing.assert_close(after["state"][name][key], value, rtol=0, atol=0)


def test_empty_optimizer_refuses_non_empty_state() -> None:
    _, _, sd = _initialised()
    fresh = _adam(_params())
    with pytest.raises(ValueError, match=r"optimizer state is empty .* call init_state\(\)"):
        fresh.load_state_dict(sd)


def test_partially_initialised_optimizer_names_the_uninitialised_param() -> None:
    params = _params()
    opt = _adam(params)
    params["w"].grad = torch.ones_like(params["w"])
    opt.step()  # only w has state
    _, _, sd = _initialised()
    with pytest.raises(ValueError, match=r"parameters 'b' have no state in this optimizer"):
        opt.load_state_dict(sd)


def test_param_group_errors() -> None:
    opt, _, sd = _initialised()
    opt.save_param_groups(True)
    with pytest.raises(ValueError, match=r"no 'param_groups' but save_param_groups\(True\)"):
        opt.load_state_dict(sd)
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["params"] = ["w"]
    with pytest.raises(ValueError, match=r"no param group with params 'b', 'w'"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    del bad["param_groups"][0]["betas"]
    with pytest.raises(ValueError, match=r"state_dict lacks 'betas'"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["param_groups"].append(bad["param_groups"][0])
    with pytest.raises(ValueError, match=r"2 param groups, this optimizer 1"):
        opt.load_state_dict(bad)


def test_constructor_errors() -> None:
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    with pytest.raises(
        ValueError, match=r"All state keys must be params: state key 'non_param_state_key'"
    ):
        DummyKeyed(
            {"p": p}, {p: {}, "non_param_state_key": [torch.tensor([1.0])]}, [{"params": [p]}]
        )
    with pytest.raises(
        ValueError, match=r"param_groups\[0\] holds a tensor of shape \(1,\) that is not in params"
    ):
        DummyKeyed({"p": p}, {}, [{"params": [p, q]}])
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no 'params'"):
        DummyKeyed({"p": p}, {}, [{"lr": 1.0}])
    with pytest.raises(ValueError, match=r"params 'p' and 'p2' are the same tensor"):
        DummyKeyed({"p": p, "p2": p}, {}, [{"params": [p]}])
    with pytest.raises(ValueError, match=r"params\['x'\] must be a Tensor"):
        DummyKeyed({"x": 3}, {}, [])  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"optimizer must be a KeyedOptimizer, got SGD"):
        OptimizerWrapper(torch.optim.SGD([p], lr=1.0))  # type: ignore[arg-type]


# ------------------------------------------------------------------ init_state
@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
        lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5, amsgrad=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.5, initial_accumulator_value=0.3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
        lambda ps: torch.optim.Adafactor(ps, lr=0.1, weight_decay=0.5),
    ],
    ids=["adamw", "adam-amsgrad", "adagrad", "sgd-momentum", "adafactor"],
)
def test_init_state_keeps_weights_and_step_counters(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> None:
    params = _params()
    for p in params.values():
        p.grad = torch.full_like(p, 5.0)  # a pending gradient must survive too
    weights = {k: p.detach().clone() for k, p in params.items()}
    opt = KeyedOptimizerWrapper(params, factory)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.init_state()
    assert calls == []  # no user-visible step
    for k, p in params.items():
        assert torch.equal(p, weights[k]), k
        assert torch.all(p.grad == 5.0)
        state = opt.state[p]
        assert state, f"no state created for {k}"
        if "step" in state:
            assert float(state["step"]) == 0.0
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and key != "sum":
                assert torch.all(value == 0), (k, key)  # nothing from decay leaked into state
    if "sum" in opt.state[params["w"]]:
        assert torch.all(opt.state[params["w"]]["sum"] == 0.3)
    # The first real step equals a fresh torch optimizer's first step.
    ref_params = {k: nn.Parameter(w.clone()) for k, w in weights.items()}
    ref = factory(list(ref_params.values()))
    for k in params:
        ref_params[k].grad = torch.full_like(ref_params[k], 5.0)
    opt.step()
    ref.step()
    for k in params:
        torch.testing.assert_close(params[k], ref_params[k])


def test_init_state_leaves_zero_gradients_where_there_were_none() -> None:
    """As TorchRec: dense zeros, or sparse ones for the named parameters; the next real
    step equals a fresh optimizer's."""
    params = _params()
    opt = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5))
    opt.init_state({"b"})
    grad_w, grad_b = params["w"].grad, params["b"].grad
    assert grad_w is not None and not grad_w.is_sparse and not grad_w.any()
    assert grad_b is not None and grad_b.is_sparse and grad_b._nnz() == 0
    assert "momentum_buffer" in opt.state_dict()["state"]["w"]


def test_init_state_leaves_initialised_params_alone() -> None:
    params = _params()
    opt = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    params["w"].grad = torch.ones_like(params["w"])
    opt.step()
    buf = opt.state[params["w"]]["momentum_buffer"].clone()
    w = params["w"].detach().clone()
    opt.init_state()
    assert torch.equal(opt.state[params["w"]]["momentum_buffer"], buf)
    assert torch.equal(params["w"], w)
    assert params["b"] in opt.state


def test_init_state_skips_frozen_and_rejects_unknown_sparse_names() -> None:
    params = _params()
    params["b"].requires_grad_(False)
    opt = _adam(params)
    opt.init_state()
    assert params["b"] not in opt.state and params["w"] in opt.state
    with pytest.raises(
        ValueError, match=r"sparse_grad_parameter_names has unknown parameters 'nope'"
    ):
        opt.init_state({"nope"})


# ------------------------------------------------------------------ wrapper specifics
def test_sparse_adam_with_sparse_embedding_gradients() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    ref = nn.Embedding(10, 4, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = KeyedOptimizerWrapper(
        dict(emb.named_parameters()), lambda ps: torch.optim.SparseAdam(ps, lr=0.1)
    )
    opt.init_state()  # SparseAdam needs sparse zero gradients: chosen automatically
    assert torch.equal(emb.weight, ref.weight)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
    for module, o in ((emb, opt), (ref, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            module(ids).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(emb.weight, ref.weight)
    assert float(opt.state_dict()["state"]["weight"]["step"]) == 2


def test_add_param_group_with_named_params() -> None:
    params = _params()
    opt = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=0.1))
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [("extra", extra)], "lr": 0.5})
    assert opt.params["extra"] is extra and opt.param_groups[1]["lr"] == 0.5
    extra.grad = torch.ones(2)
    opt.step()
    torch.testing.assert_close(extra, torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"needs a name for every new tensor"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(ValueError, match=r"param name 'w' is already bound"):
        opt.add_param_group({"params": [("w", nn.Parameter(torch.ones(1)))]})
    twice = [("y", nn.Parameter(torch.ones(1))), ("y", nn.Parameter(torch.ones(1)))]
    with pytest.raises(ValueError, match=r"param name 'y' is already bound"):  # in one call
        opt.add_param_group({"params": twice})
    assert "y" not in opt.params and len(opt.param_groups) == 2
    with pytest.raises(NotImplementedError, match=r"cannot add param groups"):
        DummyKeyed({}, {}, []).add_param_group({"params": []})


# ------------------------------------------------------------------ property: strict loader
_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
_leaf = st.one_of(_shapes.map(lambda s: torch.zeros(s)), st.integers(0, 5))
_state = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from("abc"), inner, min_size=1, max_size=3),
    ),
    max_leaves=6,
)


def _fill(value: Any, offset: float) -> Any:
    """A same-structure copy with new values (tensors offset, ints shifted)."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, offset)
    if isinstance(value, dict):
        return {k: _fill(v, offset) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, offset) for v in value]
    return value + 1


def _tensor_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, torch.Tensor):
        return [path]
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else []
    )
    return [q for k, v in items for q in _tensor_paths(v, (*path, k))]


@settings(max_examples=40, deadline=None)
@given(
    state=st.dictionaries(st.sampled_from(["x", "y"]), _state, min_size=1, max_size=2),
    data=st.data(),
)
def test_loader_accepts_same_structure_and_rejects_any_reshaped_tensor(
    state: dict[str, Any], data: Any
) -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = DummyKeyed({"p": p}, {p: copy.deepcopy(state)}, [{"params": [p]}])
    new = _fill(state, 2.0)
    opt.load_state_dict({"state": {"p": new}})
    assert _tensor_paths(opt.state[p]) == _tensor_paths(new)
    for path in _tensor_paths(new):
        got, want = opt.state[p], new
        for k in path:
            got, want = got[k], want[k]
        assert torch.equal(got, want)
    paths = _tensor_paths(new)
    if paths:
        path = data.draw(st.sampled_from(paths))
        bad = _fill(state, 3.0)
        holder = bad
        for k in path[:-1]:
            holder = holder[k]
        holder[path[-1]] = torch.zeros(*holder[path[-1]].shape, 2)
        before = copy.deepcopy(opt.state[p])
        with pytest.raises(ValueError, match=r"parameter 'p'.* shape"):
            opt.load_state_dict({"state": {"p": bad}})
        assert _tensor_paths(opt.state[p]) == _tensor_paths(before)
        for q in _tensor_paths(before):
            got, want = opt.state[p], before
            for k in q:
                got, want = got[k], want[k]
            assert torch.equal(got, want)  # nothing partially loaded
