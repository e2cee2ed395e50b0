"""fbgemm's CUDA Adam behind recopt's state: the mapping, checked on CPU with plain tensors.

fbgemm's CPU build has no ADAM kernel, so its update is written out here from its CUDA code
(codegen/genscript/optimizers.py: ``adam`` and ``partial_rowwise_adam``) and run with the eps
and step counter that `FbgemmSteps` gives it; it must equal recopt's adam / row-wise adam
(SparseAdam's formula). The CUDA tier (tests/test_cuda.py) runs the real kernel.
"""

from __future__ import annotations

import collections
import math
from types import SimpleNamespace

import pytest
import torch

from recopt.kernels import updates
from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.factory import auto_candidates
from recopt.kernels.fbgemm_backend import fbgemm_problems, name_fbgemm_states
from recopt.kernels.fbgemm_steps import FbgemmSteps, shared_step
from recopt.kernels.registry import optimizer_spec

OptimizerArgs = collections.namedtuple("OptimizerArgs", ["eps", "beta1", "beta2"])
TABLES = [TableSpec(name="t0", num_embeddings=30, embedding_dim=8)]


def _fbgemm_adam_rows(
    weight: torch.Tensor,
    m1: torch.Tensor,
    m2: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    args: OptimizerArgs,
    iteration: int,
) -> None:
    """fbgemm's CUDA ADAM (per element m2) or PARTIAL_ROWWISE_ADAM (m2 per row), no decay."""
    b1, b2, eps = args.beta1, args.beta2, args.eps
    m1[rows] = b1 * m1[rows] + (1.0 - b1) * grad
    if m2.dim() == 2:
        m2[rows] = b2 * m2[rows] + (1.0 - b2) * grad * grad
        v_hat = m2[rows] / (1.0 - b2**iteration)
    else:
        m2[rows] = b2 * m2[rows] + (1.0 - b2) * (grad * grad).mean(dim=1)
        v_hat = (m2[rows] / (1.0 - b2**iteration)).unsqueeze(1)
    weight[rows] -= lr * (m1[rows] / (1.0 - b1**iteration) / (v_hat.sqrt() + eps))


def _fake_tbe(eps: float) -> SimpleNamespace:
    return SimpleNamespace(
        iter=torch.zeros(1, dtype=torch.int64),
        iter_cpu=torch.zeros(1, dtype=torch.int64),
        optimizer_args=OptimizerArgs(eps=eps, beta1=0.9, beta2=0.999),
    )


def _run_both(name: str, mapped: bool) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Five steps of fbgemm's formula (eps mapped or as given) and of recopt's, same inputs."""
    config = FusedOptimizerConfig(name=name, lr=0.02, eps=1e-3, betas=(0.8, 0.95))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    ours = {k: v.double() for k, v in updates.init_state(name, 30, 8, torch.device("cpu")).items()}
    ours["step"] = ours["step"].long()
    ours["weight"] = weight.clone()
    theirs = [ours["exp_avg"].clone(), ours["exp_avg_sq"].clone()]
    step_tensor = torch.zeros((), dtype=torch.int64)
    steps = FbgemmSteps([step_tensor], ["t0"], eps=1e-3, beta2=0.95)
    tbe = _fake_tbe(eps=1e-3)
    tbe.optimizer_args = OptimizerArgs(eps=1e-3, beta1=0.8, beta2=0.95)
    for _ in range(5):
        rows = torch.randperm(30, generator=gen)[:12].sort().values
        grad = torch.randn(12, 8, generator=gen, dtype=torch.float64)
        # fbgemm: counter set before forward, advanced by fbgemm itself, used in backward.
        iteration = steps.before_forward(tbe, [step_tensor])
        assert int(tbe.iter_cpu) + 1 == iteration
        args = tbe.optimizer_args if mapped else tbe.optimizer_args._replace(eps=1e-3)
        _fbgemm_adam_rows(weight, *theirs, rows, grad, 0.02, args, iteration)
        steps.after_update([step_tensor])
        ours["step"].add_(1)
        state = {k: v for k, v in ours.items() if k != "weight"}
        updates.apply_update(config, 0.02, ours["weight"], state, rows, grad)
    assert int(step_tensor) == 5
    return weight, theirs, ours


@pytest.mark.parametrize("name", ["adam", "row_wise_adam"])
def test_fbgemm_adam_with_mapped_eps_equals_recopts_adam(name: str) -> None:
    weight, theirs, ours = _run_both(name, mapped=True)
    torch.testing.assert_close(weight, ours["weight"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(theirs[0], ours["exp_avg"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(theirs[1], ours["exp_avg_sq"], rtol=1e-12, atol=1e-14)
    unmapped, _, _ = _run_both(name, mapped=False)  # fbgemm's own eps: a different update
    assert not torch.allclose(unmapped, ours["weight"], rtol=1e-6, atol=1e-8)


def test_steps_follow_a_load_and_refuse_unequal_counters() -> None:
    tensors = [torch.zeros((), dtype=torch.int64) for _ in range(2)]
    steps = FbgemmSteps(tensors, ["a", "b"], eps=1e-8, beta2=0.999)
    tbe = _fake_tbe(eps=1e-8)
    assert steps.before_forward(tbe, tensors) == 1
    steps.after_update(tensors)
    assert [int(t) for t in tensors] == [1, 1]
    for t in tensors:
        t.fill_(41)  # a checkpoint load, equal steps
    assert steps.before_forward(tbe, tensors) == 42
    assert int(tbe.iter) == int(tbe.iter_cpu) == 41
    assert tbe.optimizer_args.eps == pytest.approx(1e-8 / math.sqrt(1.0 - 0.999**42))
    tensors[1].fill_(7)
    with pytest.raises(ValueError, match=r"'a': 41, 'b': 7.*backend='recopt'"):
        steps.before_forward(tbe, tensors)
    assert shared_step([], []) == 0


@pytest.mark.parametrize("name", ["adam", "row_wise_adam", "lamb", "row_wise_lamb"])
def test_state_names_round_trip_through_fbgemm_views(name: str) -> None:
    spec = optimizer_spec(name)
    per_element = not spec.row_wise
    flat = [torch.arange(30 * 8, dtype=torch.float32)]
    second = torch.arange(30 * (8 if per_element else 1), dtype=torch.float32) * 0.5
    views = [[flat[0].view(30, 8), second.view(30, 8) if per_element else second.view(30)]]
    step = torch.full((), 3, dtype=torch.int64)
    (state,) = name_fbgemm_states(spec.fbgemm_states, views, [step])
    assert set(state) == {key for key, _ in spec.states} | {"step"}
    for key, shape in spec.states:
        assert tuple(state[key].shape) == shape.size(30, 8)
    # A checkpoint written by recopt's kernel loads through the names into fbgemm's storage.
    recopt_state = updates.init_state(name, 30, 8, torch.device("cpu"))
    for value in recopt_state.values():
        value.fill_(2)
    for key, value in recopt_state.items():
        state[key].copy_(value)
    assert torch.equal(flat[0], torch.full_like(flat[0], 2.0))
    assert torch.equal(second, torch.full_like(second, 2.0))
    assert int(step) == 2
    # And back: fbgemm's storage read under recopt's names is the state recopt wrote.
    (again,) = name_fbgemm_states(spec.fbgemm_states, views, [step])
    for key, value in recopt_state.items():
        assert torch.equal(again[key], value)


def test_fbgemm_runs_adam_on_cuda_only_and_without_weight_decay() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for name in ("adam", "row_wise_adam"):
        assert fbgemm_problems(TABLES, FusedOptimizerConfig(name=name), cuda) == []
        decayed = FusedOptimizerConfig(name=name, weight_decay=0.01)
        (problem,) = fbgemm_problems(TABLES, decayed, cuda)
        assert "weight_decay=0.01" in problem and "AdamW" in problem
        (problem,) = fbgemm_problems(TABLES, FusedOptimizerConfig(name=name), cpu)
        assert "not supported by the fbgemm backend on cpu" in problem
        request = auto_candidates(TABLES, FusedOptimizerConfig(name=name), cpu)
        assert request is not None and request[1] == [Backend.RECOPT]
    request = auto_candidates(TABLES, FusedOptimizerConfig(name="adam"), cuda)
    assert request is not None and request[1] == [Backend.FBGEMM, Backend.RECOPT]
    assert fbgemm_problems(TABLES, FusedOptimizerConfig(name="adafactor"), cuda)
