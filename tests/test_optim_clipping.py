"""GradientClippingOptimizer on one process: NORM / VALUE against torch's clip utilities."""

from __future__ import annotations

import logging
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
)


def _setup(
    grads: dict[str, torch.Tensor], **kw: object
) -> tuple[GradientClippingOptimizer, dict[str, nn.Parameter]]:
    params = {k: nn.Parameter(torch.zeros_like(g)) for k, g in grads.items()}
    for k, g in grads.items():
        params[k].grad = g.clone()
    inner = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=1.0))
    return GradientClippingOptimizer(inner, **kw), params  # type: ignore[arg-type]


def test_norm_max_zero_zeroes_gradients() -> None:
    opt, params = _setup(
        {"a": torch.tensor([3.0, 4.0])}, clipping=GradientClipping.NORM, max_gradient=0.0
    )
    opt.step()
    assert torch.all(params["a"] == 0) and torch.all(params["a"].grad == 0)


def test_norm_small_gradients_untouched() -> None:
    g = torch.tensor([0.03, -0.04])
    opt, params = _setup({"a": g}, clipping=GradientClipping.NORM, max_gradient=1.0)
    opt.step()
    assert torch.equal(params["a"].grad, g)
    assert float(opt.last_norm) == pytest.approx(0.05)  # type: ignore[arg-type]


def test_norm_single_parameter_scaled_by_inverse_norm() -> None:
    g = torch.tensor([3.0, 4.0])
    opt, params = _setup({"a": g}, clipping=GradientClipping.NORM, max_gradient=1.0)
    opt.step()
    torch.testing.assert_close(params["a"].grad, g / 5.0)
    torch.testing.assert_close(params["a"].detach(), -g / 5.0)  # SGD lr 1 used the clipped grad


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf"), "inf"])
def test_joint_norm_of_two_matches_torch(norm_type: float | str) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(4, 3, generator=gen) * 5, "b": torch.randn(7, generator=gen) * 5}
    opt, params = _setup(
        grads, clipping=GradientClipping.NORM, max_gradient=0.5, norm_type=norm_type
    )
    ref = [nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(ref, grads.values(), strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=float(norm_type))
    opt.step()
    assert float(opt.last_norm) == pytest.approx(float(total), rel=1e-6)  # type: ignore[arg-type]
    for name, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(params[name].grad, r.grad)


def test_a_nan_norm_makes_the_gradients_nan_as_torch() -> None:
    """Without skip_nonfinite, a NaN norm clips as torch.nn.utils.clip_grad_norm_ does (the
    gradients become NaN); they used to stay unclipped, the step then taken in full."""
    g = torch.tensor([100.0, float("nan"), -50.0])
    opt, params = _setup({"a": g}, clipping=GradientClipping.NORM, max_gradient=1.0)
    reference = nn.Parameter(torch.zeros(3))
    reference.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([reference], 1.0)
    opt.step()
    assert torch.isnan(reference.grad).all() and torch.isnan(params["a"].grad).all()


def test_value_clipping_matches_torch_and_none_is_identity() -> None:
    g = torch.tensor([-3.0, -0.05, 0.0, 0.2, 7.0])
    opt, params = _setup({"a": g}, clipping=GradientClipping.VALUE, max_gradient=0.1)
    opt.step()
    ref = g.clone().requires_grad_()
    ref.grad = g.clone()
    torch.nn.utils.clip_grad_value_([ref], 0.1)
    assert torch.equal(params["a"].grad, ref.grad)
    opt, params = _setup({"a": g}, clipping=GradientClipping.NONE)
    opt.step()
    assert torch.equal(params["a"].grad, g) and opt.last_norm is None


def test_sparse_gradients_with_duplicate_ids_clip_like_dense() -> None:
    emb = nn.Embedding(6, 2, sparse=True)
    dense = nn.Embedding(6, 2)
    dense.load_state_dict(emb.state_dict())
    ids = torch.tensor([1, 1, 4])  # a repeated id: the sparse gradient has duplicates
    results = []
    for module in (emb, dense):
        inner = KeyedOptimizerWrapper(
            dict(module.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=1.0)
        )
        opt = GradientClippingOptimizer(inner, GradientClipping.NORM, max_gradient=0.1)
        (module(ids) * 10).sum().backward()
        opt.step()
        results.append((module.weight.detach().clone(), float(opt.last_norm)))  # type: ignore[arg-type]
    torch.testing.assert_close(results[0][0], results[1][0])
    assert results[0][1] == pytest.approx(results[1][1])
    emb.weight.grad = None
    (emb(ids) * 10).sum().backward()
    value = GradientClippingOptimizer(
        KeyedOptimizerWrapper({"w": emb.weight}, lambda ps: torch.optim.SGD(ps, lr=0.0)),
        GradientClipping.VALUE,
        max_gradient=15.0,
    )
    value.step()
    assert float(emb.weight.grad.to_dense().abs().max()) == 15.0  # 20 (summed dup) clamped


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skip_nonfinite_step(bad: float, caplog: pytest.LogCaptureFixture) -> None:
    opt, params = _setup(
        {"a": torch.tensor([1.0, bad]), "b": torch.ones(2)},
        clipping=GradientClipping.VALUE,
        max_gradient=1.0,
        skip_nonfinite=True,
    )
    with caplog.at_level(logging.WARNING, logger="recopt.optim.clipping"):
        opt.step()
    assert opt.num_skipped_steps == 1
    assert torch.all(params["a"] == 0) and torch.all(params["b"] == 0)  # no update at all
    assert "step skipped" in caplog.text
    params["a"].grad = torch.ones(2)
    opt.step()
    assert opt.num_skipped_steps == 1 and torch.all(params["b"] == -1.0)


def test_closure_runs_before_clipping() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt = GradientClippingOptimizer(
        KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=1.0)),
        GradientClipping.NORM,
        max_gradient=1.0,
    )

    def closure() -> torch.Tensor:
        loss = (p * torch.tensor([30.0, 40.0])).sum()
        loss.backward()
        return loss

    opt.step(closure)
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8]))


def test_constructor_errors() -> None:
    inner = KeyedOptimizerWrapper(
        {"p": nn.Parameter(torch.zeros(1))}, lambda ps: torch.optim.SGD(ps, lr=1.0)
    )
    with pytest.raises(ValueError, match=r"clipping must be a GradientClipping, got 'norm'"):
        GradientClippingOptimizer(inner, "norm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_gradient must be finite and >= 0, got -1"):
        GradientClippingOptimizer(inner, GradientClipping.NORM, max_gradient=-1)
    with pytest.raises(ValueError, match=r"max_gradient must be finite and >= 0, got nan"):
        GradientClippingOptimizer(inner, GradientClipping.NORM, max_gradient=float("nan"))
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match=r"norm_type must be > 0"):
            GradientClippingOptimizer(inner, GradientClipping.NORM, norm_type=bad)
    with pytest.raises(ValueError, match=r"split_params names 'q', which are not parameters"):
        GradientClippingOptimizer(inner, GradientClipping.NORM, split_params={"q": None})
    split = GradientClippingOptimizer(inner, GradientClipping.NORM, split_params={"p": None})
    with pytest.raises(
        ValueError, match=r"parameter 'p' is split .* torch.distributed is not initialised"
    ):
        split.step()


class _Fused(FusedOptimizer):
    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def test_fused_parameters_are_neither_counted_nor_clipped() -> None:
    table = nn.Parameter(torch.zeros(3))
    table.grad = torch.full((3,), 100.0)  # whatever a fused module leaves here is not a gradient
    fused = _Fused({"table": table}, {}, [{"params": [table], "lr": 0.1}])
    dense_p = nn.Parameter(torch.zeros(2))
    dense_p.grad = torch.tensor([3.0, 4.0])
    dense = KeyedOptimizerWrapper({"w": dense_p}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    opt = GradientClippingOptimizer(
        CombinedOptimizer([("sparse", fused), ("dense", dense)]),
        GradientClipping.NORM,
        max_gradient=1.0,
    )
    opt.step()
    assert float(opt.last_norm) == pytest.approx(5.0)  # type: ignore[arg-type]
    assert torch.all(table.grad == 100.0)
    torch.testing.assert_close(dense_p.grad, torch.tensor([0.6, 0.8]))
