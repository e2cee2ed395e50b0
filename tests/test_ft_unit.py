"""Fault tolerance, cheapest tier: quorum rules, recovery plans, the optimizer wrapper."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from recopt.ft import ManagerConfig, OptimizerWrapper
from recopt.ft.healing import plan_recovery
from recopt.ft.lighthouse import LighthouseConfig, QuorumState


def _member(name: str, step: int = 0, first: bool = False, errored: bool = False) -> dict:
    return {"replica_id": name, "step": step, "first": first, "errored": errored}


def _state(min_replicas: int = 1) -> QuorumState:
    return QuorumState(
        LighthouseConfig(
            min_replicas=min_replicas,
            join_timeout=datetime.timedelta(seconds=5),
            heartbeat_timeout=datetime.timedelta(seconds=2),
        )
    )


def test_quorum_waits_for_live_replicas_until_join_timeout() -> None:
    qs = _state()
    qs.heartbeat("b", now=0.0)
    r = qs.join(_member("a"), now=0.0)
    assert not qs.try_form(now=1.0)  # b is alive: wait for it
    assert qs.try_form(now=5.5)  # ... but not longer than the join timeout
    quorum = qs.quorum(r)
    assert quorum is not None and [m["replica_id"] for m in quorum["members"]] == ["a"]


def test_quorum_forms_without_dead_replicas_and_respects_min_replicas() -> None:
    qs = _state(min_replicas=2)
    qs.heartbeat("b", now=0.0)
    qs.join(_member("a"), now=3.0)  # b's heartbeat expired at 2.0
    assert not qs.try_form(now=100.0)  # one live replica < min_replicas: never forms
    r = qs.join(_member("c"), now=100.0)
    assert qs.try_form(now=100.0)
    quorum = qs.quorum(r)
    assert quorum is not None and [m["replica_id"] for m in quorum["members"]] == ["a", "c"]


def test_quorum_id_changes_with_membership_or_errors_only() -> None:
    qs = _state()
    ids = []
    for members in (["a", "b"], ["a", "b"], ["a"], ["a"], ["a", "b"]):
        for name in members:
            r = qs.join(_member(name), now=0.0)
        assert qs.try_form(now=10.0)
        ids.append(qs.quorum(r)["members"] and qs.quorum(r)["quorum_id"])  # type: ignore[index]
    assert ids == [1, 1, 2, 2, 3]
    r = qs.join(_member("a", errored=True), now=0.0)
    qs.join(_member("b"), now=0.0)
    assert qs.try_form(now=10.0)
    assert qs.quorum(r)["quorum_id"] == 4  # type: ignore[index]


def test_vote_is_refused_by_one_no_or_one_dead_member() -> None:
    qs = _state()
    qs.join(_member("a"), now=0.0)
    r = qs.join(_member("b"), now=0.0)
    assert qs.try_form(now=0.0)
    qs.vote(r, "a", 0, True, now=0.5)
    assert qs.decision(r, now=0.5) is None  # b has not voted and is alive
    assert qs.decision(r, now=2.6) is False  # b's heartbeat expired before it voted
    qs.vote(r, "b", 0, True, now=2.7)  # a late yes cannot change a decision
    assert qs.decision(r, now=2.7) is False

    r2 = qs.join(_member("a"), now=3.0)
    qs.join(_member("b"), now=3.0)
    assert qs.try_form(now=3.0)
    qs.vote(r2, "b", 0, False, now=3.1)
    assert qs.decision(r2, now=3.1) is False  # no need to wait for a
    r3 = qs.join(_member("a"), now=4.0)
    qs.join(_member("b"), now=4.0)
    assert qs.try_form(now=4.0)
    qs.vote(r3, "a", 0, True, now=4.0)
    qs.vote(r3, "b", 0, True, now=4.0)
    assert qs.decision(r3, now=4.0) is True
    assert qs.decision(12345, now=4.0) is False  # unknown round: refused, never committed


def test_sharded_groups_join_and_vote_with_every_rank() -> None:
    qs = _state()

    def rank(name: str, r: int, size: int = 2) -> dict:
        return {**_member(name), "group_rank": r, "group_world_size": size, "address": f"{name}{r}"}

    qs.heartbeat("b", now=0.0)
    qs.join(rank("a", 1), now=0.0)
    qs.join(rank("b", 0), now=0.0)
    assert not qs.try_form(now=0.5)  # neither group has all its ranks yet
    r = qs.join(rank("a", 0), now=0.6)
    assert not qs.try_form(now=0.7)  # b is live: wait for its rank 1
    assert qs.try_form(now=5.5)  # ... until the join timeout: b is left out
    quorum = qs.quorum(r)
    assert quorum is not None and len(quorum["members"]) == 1
    assert quorum["members"][0]["addresses"] == ["a0", "a1"]
    qs.heartbeat("a", now=5.5, group_rank=1)
    qs.vote(r, "a", 0, True, now=5.6)
    assert qs.decision(r, now=5.6) is None  # rank 1 of a has not voted, and is alive
    qs.vote(r, "a", 1, True, now=5.7)
    assert qs.decision(r, now=5.7) is True
    # One silent rank makes its whole group dead: its pending vote is a no at once.
    r2 = qs.join(rank("a", 0), now=6.0)
    qs.join(rank("a", 1), now=6.0)
    assert qs.try_form(now=6.0)
    qs.vote(r2, "a", 0, True, now=6.1)
    assert "a" in qs.live(now=7.9) and qs.decision(r2, now=7.9) is None
    qs.heartbeat("a", now=8.5, group_rank=0)
    assert "a" not in qs.live(now=8.5)  # rank 1 silent since 6.0
    assert qs.decision(r2, now=8.5) is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_replicas": 0}, "min_replicas=0"),
        ({"join_timeout": datetime.timedelta(seconds=-1)}, "join_timeout"),
        ({"heartbeat_timeout": datetime.timedelta(0)}, "heartbeat_timeout"),
    ],
)
def test_lighthouse_config_errors_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LighthouseConfig(**kwargs)


def test_plan_recovery() -> None:
    members = [_member("a", 5), _member("b", 3), _member("c", 5), _member("d", 0, first=True)]
    assert plan_recovery(members, init_sync=True) == {"b": "a", "d": "c"}
    fresh = [_member("a", 0, first=True), _member("b", 0, first=True), _member("c", 0)]
    assert plan_recovery(fresh, init_sync=True) == {"b": "a"}
    assert plan_recovery(fresh, init_sync=False) == {}


@pytest.mark.parametrize(
    "field, value, match",
    [("replica_id", "", "replica_id"), ("min_replica_size", 0, "min_replica_size")],
)
def test_manager_config_errors_name_the_field(field: str, value: Any, match: str) -> None:
    kwargs: dict[str, Any] = {"replica_id": "a", "lighthouse": ("localhost", 1), field: value}
    with pytest.raises(ValueError, match=match):
        ManagerConfig(**kwargs)


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


def test_manager_survives_a_lighthouse_restart() -> None:
    """Steps error while the lighthouse is down, nothing is applied; then training resumes."""
    from recopt.ft import Manager
    from recopt.ft.lighthouse import Lighthouse

    first = Lighthouse(LighthouseConfig(), host="127.0.0.1", port=0)
    first.start()
    port = first.port
    model = nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    short = datetime.timedelta(seconds=1)
    config = ManagerConfig(
        replica_id="solo",
        lighthouse=("127.0.0.1", port),
        timeout=short,
        quorum_timeout=short,
        hostname="127.0.0.1",
    )
    manager = Manager(config, state_dict=model.state_dict, load_state_dict=model.load_state_dict)
    optim = OptimizerWrapper(manager, inner)

    def step() -> None:
        optim.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        optim.step()

    second = None
    try:
        step()
        assert manager.current_step() == 1
        first.shutdown()
        weight = model.weight.detach().clone()
        step()
        assert manager.errored() is not None and manager.current_step() == 1
        assert torch.equal(weight, model.weight)
        second = Lighthouse(LighthouseConfig(), host="127.0.0.1", port=port)
        second.start()
        step()
        assert manager.errored() is None and manager.current_step() == 2
    finally:
        manager.shutdown()
        if second is not None:
            second.shutdown()


def test_manager_config_from_env() -> None:
    from recopt.ft.launch import manager_config_from_env, parse_address

    env = {
        "RECOPT_FT_LIGHTHOUSE": "node0:29510",
        "RECOPT_FT_REPLICA_ID": "group1",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    config = manager_config_from_env(env)
    assert config.lighthouse == ("node0", 29510) and config.replica_id == "group1"
    assert (config.group_rank, config.group_world_size, config.min_replica_size) == (1, 2, 1)
    with pytest.raises(ValueError, match="RECOPT_FT_REPLICA_ID is not set"):
        manager_config_from_env({"RECOPT_FT_LIGHTHOUSE": "node0:1"})
    with pytest.raises(ValueError, match="RECOPT_FT_MIN_REPLICAS='two'"):
        manager_config_from_env({**env, "RECOPT_FT_MIN_REPLICAS": "two"})
    with pytest.raises(ValueError, match="group_rank=2"):
        manager_config_from_env({**env, "RANK": "2"})
    with pytest.raises(ValueError, match="not host:port"):
        parse_address("node0")
