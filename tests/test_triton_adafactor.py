"""recopt's Triton Adafactor row pass equals the torch one (CPU: Triton's interpreter; CUDA).

Triton is not a dependency: without it these tests skip. On a CPU host with Triton installed
the kernels run under ``TRITON_INTERPRET=1``; on a GPU host (torch ships Triton) they compile,
and the ``cuda`` tier checks the recopt backend on CUDA against the CPU kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from triton_helpers import interpreted_module

from recopt.kernels import updates
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

EPS1 = torch.finfo(torch.float32).eps


@pytest.fixture
def interpreted() -> ModuleType:
    """The kernel module under Triton's CPU interpreter."""
    return interpreted_module("recopt.kernels.triton_adafactor")


def _inputs(rows: int, dim: int, count: int, scale: float, device: str) -> tuple:
    gen = torch.Generator().manual_seed(rows * dim + count)
    weight = torch.randn(rows, dim, generator=gen)
    touched = torch.randperm(rows, generator=gen)[:count].sort().values
    grad = torch.randn(count, dim, generator=gen) * scale
    row_var = torch.rand(rows, generator=gen) + 0.1
    col_var = torch.rand(dim, generator=gen) + 0.1
    row_scale = row_var.mean().clamp(min=EPS1)
    alpha = torch.tensor(0.05, dtype=torch.float64)
    tensors = [weight, touched, grad, row_var, col_var, row_scale]
    return tuple(t.to(device) for t in tensors) + (alpha.to(device),)


def _compare(rows_fn: Callable[..., torch.Tensor], device: str) -> None:
    # dims: a power of two, and one that needs masking; decay on and off; clipping on and off.
    for dim, decay, scale in [(16, 1.0, 0.1), (13, 0.99, 50.0), (64, 0.9, 1.0)]:
        weight, touched, grad, row_var, col_var, row_scale, alpha = _inputs(
            40, dim, 17, scale, device
        )
        ours = weight.clone()
        reference = weight.clone()
        args = (touched, grad, row_var, col_var, row_scale, EPS1, alpha, 1.0, decay)
        change = rows_fn(ours, *args)
        expected = updates.adafactor_rows_torch(reference, *args)
        torch.testing.assert_close(ours, reference, rtol=2e-6, atol=2e-7)
        assert not torch.equal(ours, weight)  # the rows did move
        # The running sum of squares is a difference of float32 row sums: held to their
        # precision, relative to the rows' sum of squares.
        rows_sum_sq = float(weight[touched].double().square().sum())
        torch.testing.assert_close(change, expected, rtol=0, atol=1e-6 * rows_sum_sq)
        untouched = torch.ones(40, dtype=torch.bool, device=device)
        untouched[touched] = False
        assert torch.equal(ours[untouched], weight[untouched])


def test_triton_rows_equal_torch_rows_in_the_interpreter(interpreted: ModuleType) -> None:
    _compare(interpreted.adafactor_rows, "cpu")


def _train(kernel: RecoptTableBatchedEmbedding, steps: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * 6,), generator=gen)
        ids = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        device = kernel.split_embedding_weights()[0].device
        grad = torch.randn(6, 24, generator=gen).to(device)
        kernel(ids.to(device), offsets.to(device)).backward(grad)


def _adafactor_kernel(device: str) -> RecoptTableBatchedEmbedding:
    torch.manual_seed(0)
    tables = [
        TableSpec(name="t0", num_embeddings=30, embedding_dim=8),
        TableSpec(name="t1", num_embeddings=30, embedding_dim=16),
    ]
    config = FusedOptimizerConfig(name="adafactor", lr=0.05, weight_decay=0.1)
    return RecoptTableBatchedEmbedding(tables, [0, 1], config, PoolingType.SUM, device)


def _assert_same_kernels(a: RecoptTableBatchedEmbedding, b: RecoptTableBatchedEmbedding) -> None:
    for wa, wb in zip(a.split_embedding_weights(), b.split_embedding_weights(), strict=True):
        torch.testing.assert_close(wa.cpu(), wb.cpu(), rtol=1e-5, atol=1e-6)
    for sa, sb in zip(a.split_optimizer_states(), b.split_optimizer_states(), strict=True):
        for key in sa:
            torch.testing.assert_close(sa[key].cpu(), sb[key].cpu(), rtol=1e-5, atol=1e-6)


def test_adafactor_kernel_with_triton_rows_trains_like_the_torch_rows(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _adafactor_kernel("cpu")
    _train(reference, 5)
    monkeypatch.setattr(updates, "adafactor_rows_impl", lambda weight: interpreted.adafactor_rows)
    with_triton = _adafactor_kernel("cpu")
    _train(with_triton, 5)
    _assert_same_kernels(with_triton, reference)


@pytest.mark.cuda
def test_cuda_uses_the_compiled_triton_rows_and_they_equal_torch_rows() -> None:
    triton_adafactor = pytest.importorskip("recopt.kernels.triton_adafactor")
    weight = torch.zeros(4, 8, device="cuda")
    assert updates.adafactor_rows_impl(weight) is triton_adafactor.adafactor_rows
    assert updates.adafactor_rows_impl(weight.double()) is updates.adafactor_rows_torch
    _compare(triton_adafactor.adafactor_rows, "cuda")


@pytest.mark.cuda
def test_recopt_adafactor_on_cuda_equals_the_cpu_kernel_over_several_steps() -> None:
    pytest.importorskip("triton")
    on_cpu, on_gpu = _adafactor_kernel("cpu"), _adafactor_kernel("cuda")
    with torch.no_grad():
        for src, dst in zip(
            on_cpu.split_embedding_weights(), on_gpu.split_embedding_weights(), strict=True
        ):
            dst.copy_(src)
    _train(on_cpu, 6)
    _train(on_gpu, 6)
    _assert_same_kernels(on_gpu, on_cpu)
