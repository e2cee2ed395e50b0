"""torch.optim conformance of every recopt optimizer: hooks, LR schedulers, state round trip."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from recopt.optim import (
    CombinedOptimizer,
    FusedOptimizer,
    GradientClipping,
    GradientClippingOptimizer,
    KeyedOptimizerWrapper,
    OptimizerStub,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
)


class ToyFused(FusedOptimizer):
    """A FusedOptimizer whose 'backward update' is a manual SGD call (as a kernel would do)."""

    def __init__(self, weight: nn.Parameter) -> None:
        self._weight = weight
        state = {weight: {"t.momentum1": torch.zeros(weight.shape[0])}}
        super().__init__({"t.weight": weight}, state, [{"params": [weight], "lr": 0.1}])

    def backward_update(self) -> None:
        with torch.no_grad():
            self._weight -= self.param_groups[0]["lr"] * torch.ones_like(self._weight)
        self.state[self._weight]["t.momentum1"] += 1.0

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _param(seed: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)))


def _sgd(seed: int = 0) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(
        {"p": _param(seed)}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )


def _keyed() -> torch.optim.Optimizer:
    return _sgd()


def _combined() -> torch.optim.Optimizer:
    return CombinedOptimizer([("a", _sgd(0)), ("b", _sgd(1))])


def _clipping() -> torch.optim.Optimizer:
    return GradientClippingOptimizer(_sgd(), GradientClipping.NORM, max_gradient=1.0)


def _warmup() -> torch.optim.Optimizer:
    return WarmupOptimizer(
        _sgd(), [WarmupStage(WarmupPolicy.CONSTANT, max_iters=100, value=0.5)], lr=0.2
    )


def _stub() -> torch.optim.Optimizer:
    return OptimizerStub([_param(0)], lr=0.1)


def _fused() -> torch.optim.Optimizer:
    return ToyFused(_param(0))


BUILDERS = {
    "keyed": _keyed,
    "combined": _combined,
    "clipping": _clipping,
    "warmup": _warmup,
    "stub": _stub,
    "fused": _fused,
}


def _fill_grads(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_step_hooks_fire_once_in_order(name: str) -> None:
    opt = BUILDERS[name]()
    calls: list[tuple[str, Any]] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    handle = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    _fill_grads(opt)
    opt.step()
    assert calls == [("pre", opt), ("post", opt)]
    handle.remove()
    opt.step()
    assert [c[0] for c in calls] == ["pre", "post", "pre"]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_step_pre_hook_can_replace_arguments(name: str) -> None:
    opt = BUILDERS[name]()
    seen: list[int] = []

    def replace(o: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (o,), {"closure": lambda: seen.append(1) or 3.0}

    opt.register_step_pre_hook(replace)
    _fill_grads(opt)
    assert opt.step() == 3.0 and seen == [1]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_state_dict_hooks_and_round_trip(name: str) -> None:
    opt = BUILDERS[name]()
    _fill_grads(opt)
    opt.step()
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(
        lambda o, sd: {**sd, "marker": 1} if calls.append("sd-post") is None else None
    )
    sd = opt.state_dict()
    assert calls == ["sd-pre", "sd-post"] and sd["marker"] == 1

    def drop_marker(o: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("load-pre")
        return {k: v for k, v in state_dict.items() if k != "marker"}

    opt.register_load_state_dict_pre_hook(drop_marker)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    opt.load_state_dict(copy.deepcopy(sd))  # the pre-hook removes what load would reject
    assert calls[2:] == ["load-pre", "load-post"]
    again = opt.state_dict()
    assert set(again["state"]) == set(sd["state"])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_lr_scheduler_drives_every_group(name: str) -> None:
    opt = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        before = [g["lr"] for g in opt.param_groups]
        _fill_grads(opt)
        opt.step()
        scheduler.step()
    after = [g["lr"] for g in opt.param_groups]
    assert after == pytest.approx([lr * 0.5 for lr in before])
    assert scheduler.get_last_lr() == pytest.approx(after)
    inner = opt.wrapped if hasattr(opt, "wrapped") else opt
    assert [g["lr"] for g in inner.param_groups] == pytest.approx(after)  # reached the real groups


def test_scheduled_lr_is_used_by_the_update() -> None:
    combined = CombinedOptimizer([("a", _sgd(0)), ("b", _sgd(1))])
    clip = GradientClippingOptimizer(combined, GradientClipping.NONE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(clip, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    _fill_grads(clip)
    clip.step()
    scheduler.step()  # lr is now 0 in every child
    frozen = {k: p.detach().clone() for k, p in clip.params.items()}
    clip.zero_grad()
    _fill_grads(clip)
    for _, child in combined.optimizers:
        child.state[next(iter(child.params.values()))]["momentum_buffer"].zero_()
    clip.step()
    for k, p in clip.params.items():
        assert torch.equal(p, frozen[k]), k


def test_fused_update_happens_in_backward_not_step() -> None:
    opt = ToyFused(_param(0))
    weight = opt.params["t.weight"]
    before = weight.detach().clone()
    opt.step()
    assert torch.equal(weight, before)  # step applies nothing
    opt.backward_update()
    torch.testing.assert_close(weight.detach(), before - 0.1)
    opt.init_state()  # no-op: state is eager
    assert float(opt.state[weight]["t.momentum1"][0]) == 1.0


@pytest.mark.parametrize("name", list(BUILDERS))
def test_pickle_round_trip(name: str) -> None:
    opt = BUILDERS[name]()
    _fill_grads(opt)
    opt.step()
    opt.register_step_pre_hook(lambda *a: None)  # hooks are dropped, as in torch.optim
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # patches opt.step on the instance
    clone = pickle.loads(pickle.dumps(opt))
    assert type(clone) is type(opt)
    sd, clone_sd = opt.state_dict(), clone.state_dict()
    assert set(clone_sd["state"]) == set(sd["state"])
    for key, value in sd["state"].items():
        for k, v in value.items() if isinstance(value, dict) else []:
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(clone_sd["state"][key][k], v)
    _fill_grads(clone)
    clone.step()  # still a working optimizer


def test_wrapper_views_cannot_be_reassigned() -> None:
    warm = _warmup()
    for attr in ("params", "state", "param_groups", "defaults"):
        with pytest.raises(AttributeError, match=f"set {attr} on the wrapped optimizer"):
            setattr(warm, attr, {})
