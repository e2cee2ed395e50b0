"""Fault tolerance, cheapest tier: the optimizer wrapper, settings, and the torchft seam."""

from __future__ import annotations

import copy
import datetime
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from recopt.ft import OptimizerWrapper
from recopt.ft.torchft_manager import QUORUM_FUTURE, TorchftConfig, forget_failed_quorum


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("replica_id", "", "replica_id is empty"),
        ("min_replica_size", 0, "min_replica_size=0"),
        ("lighthouse_addr", "node0:29510", "lighthouse_addr='node0:29510' is not a URL"),
        ("group_rank", 2, r"group_rank=2 is not in \[0, group_world_size=2\)"),
        ("timeout", datetime.timedelta(0), "timeout=0:00:00 must be positive"),
    ],
)
def test_torchft_config_errors_name_the_field(field: str, value: Any, match: str) -> None:
    kwargs: dict[str, Any] = {
        "replica_id": "a",
        "lighthouse_addr": "http://node0:29510",
        "store_addr": "node0",
        "store_port": 29500,
        "group_world_size": 2,
        field: value,
    }
    with pytest.raises(ValueError, match=match):
        TorchftConfig(**kwargs)


def test_torchft_still_keeps_the_quorum_future_recopt_clears() -> None:
    """A failed quorum is forgotten through torchft's private ``_quorum_future`` (its public
    API re-raises it at every later step): this fails if a torchft upgrade drops it."""
    torchft_manager = pytest.importorskip("torchft.manager")
    engine = torchft_manager.Manager
    assert f"self.{QUORUM_FUTURE}: Optional" in inspect.getsource(engine.__init__)
    assert f"self.{QUORUM_FUTURE}.result()" in inspect.getsource(engine.start_quorum)

    class Engine:
        _quorum_future: object = "failed"

    stand_in = Engine()
    forget_failed_quorum(stand_in)
    assert stand_in._quorum_future is None
    with pytest.raises(AttributeError, match="_quorum_future.*torchft==0.2.0"):
        forget_failed_quorum(object())


class _StubManager:
    """Stands in for a Manager: a scripted vote, and a count of what was called."""

    def __init__(self, votes: list[bool]) -> None:
        self.votes = votes
        self.quorums = 0
        self.reduced = 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def allreduce_gradients(self, params: list[torch.Tensor]) -> None:
        self.reduced += 1

    def should_commit(self) -> bool:
        return self.votes.pop(0)


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())


def _assert_bit_identical(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bit_identical(a[k], b[k])
    elif isinstance(a, list | tuple):
        for x, y in zip(a, b, strict=True):
            _assert_bit_identical(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam_wd_amsgrad": lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5),
    "sgd_momentum_nesterov": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dropped_step_leaves_parameters_and_state_bit_identical(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inner = OPTIMIZERS[name](model.parameters())
    # Two commits build up momentum / second moments and a step count, then two drops.
    manager = _StubManager([True, True, False, False, True])
    optim = OptimizerWrapper(manager, inner)  # type: ignore[arg-type]
    for i in range(5):
        optim.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        before = _snapshot(model, inner)
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        optim.step()
        after = _snapshot(model, inner)
        if i in (2, 3):
            _assert_bit_identical(before, after)
            # The wrapper must not touch the gradients either.
            for g, p in zip(grads, model.parameters(), strict=True):
                assert torch.equal(g, p.grad)  # type: ignore[arg-type]
        else:
            assert not torch.equal(before[0]["0.weight"], after[0]["0.weight"])
    assert manager.quorums == 5 and manager.reduced == 5
    state = inner.state_dict()["state"][0]
    if "step" in state:
        assert state["step"] == 3  # only the commits counted


def test_wrapper_passes_state_through() -> None:
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    optim = OptimizerWrapper(_StubManager([True]), inner)  # type: ignore[arg-type]
    assert optim.param_groups is inner.param_groups
    optim.param_groups[0]["lr"] = 0.25
    assert inner.param_groups[0]["lr"] == 0.25
    extra = nn.Parameter(torch.zeros(3))
    optim.add_param_group({"params": [extra], "lr": 1.0})
    assert inner.param_groups[1]["params"] == [extra]
    saved = optim.state_dict()
    saved["param_groups"][0]["lr"] = 0.125
    optim.load_state_dict(saved)
    assert inner.param_groups[0]["lr"] == 0.125
    # LR schedulers accept the wrapper as an optimizer.
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    optim.zero_grad()
    optim.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == 0.0625


def test_wrapper_refuses_a_closure_before_touching_anything() -> None:
    model = nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = _StubManager([True])
    optim = OptimizerWrapper(manager, inner)  # type: ignore[arg-type]
    optim.zero_grad()
    model(torch.ones(3, 2)).sum().backward()
    weight = model.weight.detach().clone()
    with pytest.raises(ValueError, match="closure.*never averaged"):
        optim.step(lambda: 0.0)
    assert torch.equal(weight, model.weight) and manager.reduced == 0
    # The refused step left the step open: a plain step() still commits it once.
    optim.step()
    assert not torch.equal(weight, model.weight)


def test_wrapper_refuses_a_step_without_zero_grad() -> None:
    model = nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = _StubManager([True, True])
    optim = OptimizerWrapper(manager, inner)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"without zero_grad\(\).*call optimizer.zero_grad"):
        optim.step()
    optim.zero_grad()
    model(torch.ones(3, 2)).sum().backward()
    optim.step()
    weight = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="previous quorum round"):
        optim.step()
    assert torch.equal(weight, model.weight) and manager.reduced == 1 and manager.quorums == 1


def test_wrapper_delegates_torch_hooks_to_the_inner_optimizer() -> None:
    model = nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    optim = OptimizerWrapper(_StubManager([True, False]), inner)  # type: ignore[arg-type]
    calls: list[str] = []
    handles = [
        optim.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
        optim.register_step_post_hook(lambda o, a, k: calls.append("post")),
        optim.register_state_dict_pre_hook(lambda o: calls.append("sd_pre")),
        optim.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post")),
        optim.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre")),
        optim.register_load_state_dict_post_hook(lambda o: calls.append("load_post")),
    ]
    for _ in range(2):  # one commit, one dropped step: hooks run on the commit only
        optim.zero_grad()
        model(torch.ones(3, 2)).sum().backward()
        optim.step()
    optim.load_state_dict(optim.state_dict())
    assert calls == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"]
    for handle in handles:
        handle.remove()
    optim.load_state_dict(optim.state_dict())
    assert len(calls) == 6
