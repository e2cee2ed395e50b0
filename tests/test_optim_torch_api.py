"""recopt.optim against torch's Optimizer API: closures, stateful state, malformed state dicts."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from recopt.optim import (
    CombinedOptimizer,
    GradientClipping,
    GradientClippingOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerStub,
    OptimizerWrapper,
    WarmupOptimizer,
    WarmupStage,
)


class ClosureRequired(KeyedOptimizer):
    """A TorchRec-style optimizer whose ``step`` takes the closure as a required argument."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__(params, {}, [{"params": list(params.values()), "lr": 1.0}])
        self.losses: list[Any] = []

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.losses.append(loss)
        with torch.no_grad():
            for p in self.params.values():
                p.sub_(p.grad)  # SGD, lr 1
        return loss


def _param_with_grad() -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    return p


def _loss_closure(p: nn.Parameter) -> Any:
    def closure() -> torch.Tensor:
        p.grad = None
        loss = (p * torch.tensor([3.0, 4.0])).sum()
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize(
    "wrap",
    [
        lambda o: GradientClippingOptimizer(o, GradientClipping.NORM, max_gradient=1.0),
        lambda o: CombinedOptimizer([("a", o)]),
        lambda o: OptimizerWrapper(o),
        lambda o: WarmupOptimizer(o, [WarmupStage(max_iters=2, value=1.0)], lr=1.0),
    ],
    ids=["clipping", "combined", "wrapper", "warmup"],
)
def test_wrappers_pass_the_closure_to_an_inner_step_that_requires_it(wrap: Any) -> None:
    p = _param_with_grad()
    inner = ClosureRequired({"p": p})
    opt = wrap(inner)
    assert opt.step() is None  # no closure: the inner step gets None, as torch passes it
    assert inner.losses == [None]
    expected = float((p.detach() * torch.tensor([3.0, 4.0])).sum())
    loss = opt.step(_loss_closure(p))
    assert float(loss) == pytest.approx(expected) != 0.0
    assert inner.losses[1] is not None and float(inner.losses[1]) == pytest.approx(expected)


def test_clipping_with_closure_steps_on_clipped_gradients_and_returns_loss() -> None:
    p = nn.Parameter(torch.zeros(2))
    inner = ClosureRequired({"p": p})
    opt = GradientClippingOptimizer(inner, GradientClipping.NORM, max_gradient=1.0)
    loss = opt.step(_loss_closure(p))
    # Reference: torch's own clipping then SGD lr 1 on gradient (3, 4).
    ref = nn.Parameter(torch.zeros(2))
    ref.grad = torch.tensor([3.0, 4.0])
    torch.nn.utils.clip_grad_norm_([ref], 1.0)
    torch.testing.assert_close(p.detach(), -ref.grad, rtol=1e-5, atol=1e-6)
    assert float(loss) == 0.0 and float(inner.losses[0]) == 0.0


def test_init_state_reaches_an_inner_step_that_requires_the_closure() -> None:
    p = nn.Parameter(torch.ones(2))
    inner = ClosureRequired({"p": p})
    OptimizerWrapper(inner).init_state()  # one zero-gradient step through step(self, closure)
    assert inner.losses == [None] and torch.equal(p.detach(), torch.ones(2))


class Counter:
    """A stateful object (state_dict / load_state_dict) kept in optimizer state."""

    def __init__(self, n: int = 0) -> None:
        self.n = torch.tensor(n)
        self.label = "counter"

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "label": self.label}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n = state_dict["n"].clone()
        self.label = state_dict["label"]


def test_keyed_state_may_hold_stateful_objects() -> None:
    p = nn.Parameter(torch.zeros(2))
    counter = Counter(3)
    opt = _Noop({"p": p}, {p: {"counter": counter, "m": torch.ones(2)}})
    sd = copy.deepcopy(opt.state_dict())
    assert isinstance(sd["state"]["p"]["counter"], dict)
    assert int(sd["state"]["p"]["counter"]["n"]) == 3

    other = Counter(0)
    fresh = _Noop({"p": p}, {p: {"counter": other, "m": torch.zeros(2)}})
    fresh.load_state_dict(sd)
    assert fresh.state[p]["counter"] is other and int(other.n) == 3
    assert torch.equal(fresh.state[p]["m"], torch.ones(2))

    bad = copy.deepcopy(sd)
    del bad["state"]["p"]["counter"]["label"]
    with pytest.raises(ValueError, match=r"counter \(Counter\): state keys differ"):
        fresh.load_state_dict(bad)


class _Noop(KeyedOptimizer):
    def __init__(self, params: dict[str, nn.Parameter], state: dict[Any, Any]) -> None:
        super().__init__(params, state, [{"params": list(params.values()), "lr": 0.1}])

    def step(self, closure: Any = None) -> None:
        return None


@pytest.mark.parametrize(
    ("state_dict", "message"),
    [
        ({}, r"'state' dict and a 'param_groups' list"),
        ({"state": {}}, r"no 'param_groups' entry"),
        ({"state": {}, "param_groups": 3}, r"must be a list of groups"),
        ({"state": {}, "param_groups": [{"lr": 0.1}]}, r"\[0\] must be a mapping with a 'params'"),
    ],
)
def test_stub_malformed_state_dict_is_a_value_error(state_dict: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerStub().load_state_dict(state_dict)


def test_stub_round_trip_still_loads() -> None:
    stub = OptimizerStub([nn.Parameter(torch.zeros(1))], lr=0.5)
    sd = stub.state_dict()
    stub.param_groups[0]["lr"] = 0.1
    stub.load_state_dict(sd)
    assert stub.param_groups[0]["lr"] == 0.5


def test_keyed_and_combined_malformed_param_groups_are_value_errors() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt.save_param_groups(True)
    with pytest.raises(ValueError, match=r"\[0\] must be a mapping with a 'params' list"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 0.1}]})
    combined = CombinedOptimizer([("a", opt)])
    with pytest.raises(ValueError, match=r"must be a list of groups"):
        combined.load_state_dict({"state": {}, "param_groups": None})
    for wrapper in (opt, combined, GradientClippingOptimizer(combined)):
        with pytest.raises(ValueError, match=r"state_dict must be a mapping .*got NoneType"):
            wrapper.load_state_dict(None)  # type: ignore[arg-type]


def test_warmup_warns_when_its_lr_replaces_the_configured_one() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.02))
    with pytest.warns(UserWarning, match=r"lr=0.1\) replaces the wrapped optimizer's .* 0.02"):
        WarmupOptimizer(opt, [WarmupStage(max_iters=2)])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the configured 0.02 is replaced
    same = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.02))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WarmupOptimizer(same, [WarmupStage(max_iters=2)], lr=0.02)
