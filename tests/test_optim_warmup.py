"""WarmupOptimizer: every policy's multiplier, stage switching, state survival, validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from recopt.optim import (
    CombinedOptimizer,
    GradientClippingOptimizer,
    KeyedOptimizerWrapper,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
    lr_multiplier,
)


def _sgd(seed: int = 0) -> tuple[KeyedOptimizerWrapper, nn.Parameter]:
    p = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(seed)))
    return KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.5)), p


def _lrs(stages: list[WarmupStage], steps: int, lr: float = 2.0) -> list[float]:
    """The LR in force at iterations 0..steps (what step i+1 uses is lrs[i])."""
    opt, p = _sgd()
    warm = WarmupOptimizer(opt, stages, lr=lr)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        warm.step()
        out.append(opt.param_groups[0]["lr"])
    return out


# Each formula written out independently of the implementation.
POLICY_CASES = [
    (
        WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.1, lr_scale=2.0),
        lambda i: (0.1 + 0.9 * i / 10) * 2.0,
    ),
    (WarmupStage(WarmupPolicy.CONSTANT, max_iters=10, value=0.3), lambda i: 0.3),
    (WarmupStage(WarmupPolicy.POLY, max_iters=10, value=2.0), lambda i: (1 - i / 10) ** 2),
    (
        WarmupStage(WarmupPolicy.POLY, max_iters=10, value=0.5, decay_iters=20),
        lambda i: (1 - i / 20) ** 0.5,
    ),
    (
        WarmupStage(WarmupPolicy.STEP, max_iters=10, value=0.5, decay_iters=3),
        lambda i: 0.5 ** (i // 3),
    ),
    (WarmupStage(WarmupPolicy.STEP, max_iters=10, value=0.5), lambda i: 0.5**i),
    (
        WarmupStage(WarmupPolicy.INVSQRT, max_iters=10),
        lambda i: 1.0 if i == 0 else 1 / math.sqrt(i),
    ),
    (
        WarmupStage(
            WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=10, value=0.2, sgdr_period=4
        ),
        lambda i: 0.2 + 0.8 * (1 + math.cos(math.pi * (i % 4) / 4)) / 2,
    ),
    (WarmupStage(WarmupPolicy.NONE, max_iters=10, lr_scale=0.7), lambda i: 0.7),
]


@pytest.mark.parametrize(
    ("stage", "formula"), POLICY_CASES, ids=[c[0].policy.value for c in POLICY_CASES]
)
def test_policy_multipliers(stage: WarmupStage, formula: object) -> None:
    lrs = _lrs([stage], steps=12, lr=2.0)
    for i in range(11):  # iterations 0..max_iters belong to the stage
        assert lrs[i] == pytest.approx(2.0 * formula(i)), i  # type: ignore[operator]
    assert lrs[11] == pytest.approx(2.0) and lrs[12] == pytest.approx(2.0)  # past the last stage


def test_cosine_restarts_return_to_full_lr() -> None:
    stage = WarmupStage(
        WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=100, value=0.0, sgdr_period=5
    )
    resolved = WarmupOptimizer(_sgd()[0], [stage]).stages[0]
    assert [round(lr_multiplier(resolved, i), 6) for i in (0, 5, 10)] == [1.0, 1.0, 1.0]
    assert lr_multiplier(resolved, 4) < lr_multiplier(resolved, 3) < lr_multiplier(resolved, 1)


def test_stages_switch_after_max_iters_and_use_global_iterations() -> None:
    stages = [
        WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.0),
        WarmupStage(WarmupPolicy.STEP, max_iters=8, value=0.5, decay_iters=2),
    ]
    lrs = _lrs(stages, steps=10, lr=1.0)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert lrs[5:9] == pytest.approx([0.5**2, 0.5**3, 0.5**3, 0.5**4])  # 0.5 ** (it // 2)
    assert lrs[9:] == pytest.approx([1.0, 1.0])


def test_invsqrt_first_stage_does_not_divide_by_zero() -> None:
    lrs = _lrs([WarmupStage(WarmupPolicy.INVSQRT, max_iters=5)], steps=4, lr=1.0)
    assert lrs == pytest.approx([1.0, 1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5])


def test_poly_past_decay_iters_is_clamped_at_zero() -> None:
    stage = WarmupStage(WarmupPolicy.POLY, max_iters=10, value=0.5, decay_iters=4)
    assert _lrs([stage], steps=6, lr=1.0)[4:] == pytest.approx([0.0, 0.0, 0.0])


def test_state_survives_round_trip_into_fresh_optimizer() -> None:
    stages = [
        WarmupStage(WarmupPolicy.LINEAR, max_iters=100, value=0.01),
        WarmupStage(WarmupPolicy.CONSTANT, max_iters=200, value=0.5),
    ]
    opt, p = _sgd()
    warm = WarmupOptimizer(opt, stages, lr=0.3)
    for _ in range(103):
        p.grad = torch.ones_like(p)
        warm.step()
    sd = copy.deepcopy(warm.state_dict())
    assert sd["state"]["__warmup"]["warmup"].tolist() == [103, 1]

    fresh_opt, _ = _sgd()
    fresh = WarmupOptimizer(fresh_opt, stages, lr=0.3)
    fresh.init_state()
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.3 * 0.01)
    fresh.load_state_dict(sd)
    assert (fresh.iteration, fresh.stage_index) == (103, 1)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.3 * 0.5)
    torch.testing.assert_close(
        fresh_opt.state[fresh_opt.params["p"]]["momentum_buffer"], opt.state[p]["momentum_buffer"]
    )


def test_state_survives_over_combined_optimizer_and_as_a_child() -> None:
    stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.0)]

    def build() -> tuple[WarmupOptimizer, CombinedOptimizer, WarmupOptimizer]:
        a, _ = _sgd(0)
        b, _ = _sgd(1)
        c, _ = _sgd(2)
        inner_warm = WarmupOptimizer(c, stages, lr=1.0)
        combined = CombinedOptimizer([("a", a), ("b", b), ("c", inner_warm)])
        return WarmupOptimizer(combined, stages, lr=1.0), combined, inner_warm

    warm, combined, inner_warm = build()
    for _ in range(3):
        for p in combined.params.values():
            p.grad = torch.ones_like(p)
        warm.step()
    inner_warm.step()  # the child's schedule is independent: 4 steps
    sd = copy.deepcopy(warm.state_dict())
    assert sd["state"]["__warmup"]["warmup"].tolist() == [3, 0]
    assert sd["state"]["c.__warmup"]["warmup"].tolist() == [4, 0]

    fresh, fresh_combined, fresh_inner = build()
    fresh.init_state()
    fresh.load_state_dict(sd)
    assert fresh.iteration == 3 and fresh_inner.iteration == 4
    lrs = [g["lr"] for g in fresh_combined.param_groups]
    # The outer warmup wraps every group and applies last, exactly as after a normal step.
    assert lrs == pytest.approx([0.3, 0.3, 0.3])
    assert fresh.param_groups[2]["lr"] == pytest.approx(0.3)
    fresh_inner.post_load_state_dict()
    assert fresh_combined.param_groups[2]["lr"] == pytest.approx(0.4)  # the child's own position


def test_post_load_state_dict_reaches_through_combined_and_wrappers() -> None:
    """A DCP-style load fills the state tensors in place, then calls the outermost
    optimizer's ``post_load_state_dict``: it reaches a warmup inside a CombinedOptimizer or a
    clipping wrapper (it used to stop there: the lr stayed at the old position's). After
    ``load_state_dict`` each child's runs once."""
    stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.0)]
    calls: list[str] = []

    class Counted(WarmupOptimizer):
        def post_load_state_dict(self) -> None:
            calls.append("warmup")
            super().post_load_state_dict()

    for outer in (
        lambda w: CombinedOptimizer([("w", w)]),
        lambda w: GradientClippingOptimizer(w),
        lambda w: GradientClippingOptimizer(CombinedOptimizer([w])),
    ):
        warm = Counted(_sgd()[0], stages, lr=1.0)
        opt = outer(warm)
        saved = opt.state_dict()
        key = next(k for k in saved["state"] if k.endswith("__warmup"))
        saved["state"][key]["warmup"].copy_(torch.tensor([5, 0]))  # in place, as DCP
        calls.clear()
        opt.post_load_state_dict()
        assert warm.iteration == 5 and opt.param_groups[0]["lr"] == pytest.approx(0.5)
        assert calls == ["warmup"]
        moved = copy.deepcopy(opt.state_dict())
        moved["state"][key]["warmup"] = torch.tensor([7, 0])
        calls.clear()
        opt.load_state_dict(moved)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.7) and calls == ["warmup"]
        opt.post_load_state_dict()  # (the next in-place load's call runs it again)
        assert calls == ["warmup", "warmup"]


def test_load_errors() -> None:
    opt, _ = _sgd()
    warm = WarmupOptimizer(opt, [WarmupStage(max_iters=5)])
    warm.init_state()
    sd = copy.deepcopy(warm.state_dict())
    missing = copy.deepcopy(sd)
    del missing["state"]["__warmup"]
    with pytest.raises(ValueError, match=r"no warmup position '__warmup'"):
        warm.load_state_dict(missing)
    bad_stage = copy.deepcopy(sd)
    bad_stage["state"]["__warmup"]["warmup"] = torch.tensor([3, 7])
    with pytest.raises(ValueError, match=r"stage 7 does not exist"):
        warm.load_state_dict(bad_stage)
    negative = copy.deepcopy(sd)
    negative["state"]["__warmup"]["warmup"] = torch.tensor([-10, 0])  # (a negative lr)
    with pytest.raises(ValueError, match=r"iteration -10 is negative"):
        warm.load_state_dict(negative)
    bad_dtype = copy.deepcopy(sd)
    bad_dtype["state"]["__warmup"]["warmup"] = torch.tensor([3.0, 0.0])
    with pytest.raises(ValueError, match=r"warmup state '__warmup'.warmup: dtype torch.float32"):
        warm.load_state_dict(bad_dtype)
    bad_inner = copy.deepcopy(sd)
    bad_inner["state"]["__warmup"]["warmup"] = torch.tensor([4, 0])
    bad_inner["state"]["p"]["momentum_buffer"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"parameter 'p'.momentum_buffer: shape"):
        warm.load_state_dict(bad_inner)
    assert warm.iteration == 0  # nothing loaded


def test_stage_validation_does_not_mutate_caller_stages() -> None:
    stages = [
        WarmupStage(WarmupPolicy.POLY, max_iters=5),
        WarmupStage(WarmupPolicy.STEP, max_iters=9),
    ]
    before = copy.deepcopy(stages)
    warm = WarmupOptimizer(_sgd()[0], stages)
    assert stages == before and stages[0].decay_iters == -1
    assert [s.decay_iters for s in warm.stages] == [5, 1, -1]
    with pytest.raises(
        ValueError,
        match=r"stages\[1\].max_iters = 5 must be greater than the previous stage's max_iters = 5",
    ):
        WarmupOptimizer(_sgd()[0], [WarmupStage(max_iters=5), WarmupStage(max_iters=5)])
    with pytest.raises(ValueError, match=r"stages\[1\].max_iters = 3 must be greater .* = 5"):
        WarmupOptimizer(_sgd()[0], [WarmupStage(max_iters=5), WarmupStage(max_iters=3)])
    with pytest.raises(ValueError, match=r"stages\[0\] must be a WarmupStage, got dict"):
        WarmupOptimizer(_sgd()[0], [{"max_iters": 3}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"WarmupStage.max_iters must be >= 1, got 0"):
        WarmupStage(max_iters=0)
    with pytest.raises(ValueError, match=r"WarmupStage.sgdr_period must be >= 1, got 0"):
        WarmupStage(WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, sgdr_period=0)
    with pytest.raises(
        ValueError, match=r"WarmupStage.policy must be a WarmupPolicy, got 'linear'"
    ):
        WarmupStage("linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"WarmupStage.value must be finite and >= 0, got nan"):
        WarmupStage(value=float("nan"))
    with pytest.raises(ValueError, match=r"WarmupStage.lr_scale must be finite and >= 0, got -1"):
        WarmupStage(lr_scale=-1.0)  # (a negative lr: a step up the gradient)
    with pytest.raises(ValueError, match=r"param_name 'p' is already a key"):
        WarmupOptimizer(_sgd()[0], [], param_name="p")


def test_state_shows_the_position_and_writes_reach_the_wrapped_optimizer() -> None:
    inner, p = _sgd()
    warmup = WarmupOptimizer(inner, [WarmupStage(WarmupPolicy.LINEAR, max_iters=10)], lr=1.0)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        warmup.step()
    assert warmup.state["__warmup"]["warmup"].tolist() == [3, 0]
    assert list(warmup.state) == [*inner.state, "__warmup"] and len(warmup.state) == 2
    assert p in warmup.state and warmup.state[p] is inner.state[p]
    assert torch.zeros(1) not in warmup.state and len(inner.state) == 1  # lookups add nothing
    warmup.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    assert not inner.state[p]["momentum_buffer"].any()
    with pytest.raises(ValueError, match="warmup position; load it with load_state_dict"):
        warmup.state["__warmup"] = {}
