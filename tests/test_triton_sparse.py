"""recopt's Triton sort-and-update kernel (its CUDA path) equals its torch path.

Runs under Triton's CPU interpreter where Triton is installed and there is no GPU (skipped
without Triton); the ``cuda`` test compares the compiled kernel on a GPU with the CPU kernel.
"""

from __future__ import annotations

import functools
from types import ModuleType

import pytest
import torch
from triton_helpers import interpreted_module

from recopt.kernels import updates
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

OPTIMIZERS = ["sgd", "adagrad", "row_wise_adagrad", "adam", "row_wise_adam"]


@pytest.fixture
def interpreted() -> ModuleType:
    """The kernel module under Triton's CPU interpreter."""
    return interpreted_module("recopt.kernels.triton_sparse")


def _kernel(
    config: FusedOptimizerConfig, pooling: PoolingType, device: str
) -> RecoptTableBatchedEmbedding:
    torch.manual_seed(0)
    tables = [
        TableSpec(name="t0", num_embeddings=25, embedding_dim=8),
        TableSpec(name="t1", num_embeddings=12, embedding_dim=12),  # a dim that needs masking
    ]
    # f0 and f2 share t0: a row's run spans two features.
    kernel = RecoptTableBatchedEmbedding(tables, [0, 1, 0], config, pooling, device)
    kernel._use_native = False
    return kernel


def _train(kernel: RecoptTableBatchedEmbedding, weighted: bool, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    device = kernel.split_embedding_weights()[0].device
    for _ in range(steps):
        lengths = torch.randint(0, 5, (3 * 6,), generator=gen)
        lengths[0] = 12  # one long run of ids in one bag
        ids = torch.randint(0, 12, (int(lengths.sum()),), generator=gen)
        ids[:12] = 3
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        psw = torch.rand(ids.numel(), generator=gen).to(device) if weighted else None
        grad = torch.randn(6, 28, generator=gen).to(device)
        kernel(ids.to(device), offsets.to(device), psw).backward(grad)


def _power_law_ids(gen: torch.Generator, rows: torch.Tensor) -> torch.Tensor:
    """One id per entry of ``rows`` (its table's size), P(k) ~ 1 / (k + 1), as the DLRM
    script's synthetic ids: id 0 takes about a quarter of a 25-row table's ids."""
    u = torch.rand(rows.numel(), generator=gen, dtype=torch.float64)
    ids = torch.pow(rows + 1.0, u).floor().long() - 1
    return torch.minimum(ids.clamp(min=0), rows - 1)


def _train_hot(kernel: RecoptTableBatchedEmbedding, steps: int) -> list[int]:
    """Power-law ids, hundreds of copies of t0's hottest row; returns its copies per step."""
    gen = torch.Generator().manual_seed(11)
    device = kernel.split_embedding_weights()[0].device
    table_rows = torch.repeat_interleave(torch.tensor([25, 12, 25]), 6)  # f0, f1, f2 x 6 bags
    hottest = []
    for _ in range(steps):
        lengths = torch.randint(40, 120, (3 * 6,), generator=gen)
        ids = _power_law_ids(gen, torch.repeat_interleave(table_rows, lengths))
        f1 = slice(int(lengths[:6].sum()), int(lengths[:12].sum()))
        t0_ids = torch.cat([ids[: f1.start], ids[f1.stop :]])  # f0 and f2 share t0
        hottest.append(int(torch.bincount(t0_ids).max()))
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(6, 28, generator=gen).to(device)
        psw = torch.rand(ids.numel(), generator=gen).to(device)
        kernel(ids.to(device), offsets.to(device), psw).backward(grad)
    return hottest


def _assert_same(a: RecoptTableBatchedEmbedding, b: RecoptTableBatchedEmbedding) -> None:
    for wa, wb in zip(a.split_embedding_weights(), b.split_embedding_weights(), strict=True):
        torch.testing.assert_close(wa.cpu(), wb.cpu(), rtol=1e-5, atol=1e-6)
    for sa, sb in zip(a.split_optimizer_states(), b.split_optimizer_states(), strict=True):
        for key in sa:
            torch.testing.assert_close(sa[key].cpu(), sb[key].cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_triton_update_equals_the_torch_path(
    name: str, interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = [
        (FusedOptimizerConfig(name=name, lr=0.05), PoolingType.SUM, False),
        (FusedOptimizerConfig(name=name, lr=0.05, weight_decay=0.1, maximize=True),
         PoolingType.MEAN, True),
    ]  # fmt: skip
    for config, pooling, weighted in cases:
        reference = _kernel(config, pooling, "cpu")
        _train(reference, weighted, 3)
        with monkeypatch.context() as patch:
            patch.setattr(
                RecoptTableBatchedEmbedding,
                "_triton_update_fn",
                lambda self, grad_out: interpreted.sparse_update,
            )
            patch.setattr(updates, "apply_update", _must_not_run)
            with_triton = _kernel(config, pooling, "cpu")
            _train(with_triton, weighted, 3)
        _assert_same(with_triton, reference)


@pytest.mark.parametrize(
    ("name", "chunk"), [*((name, 64) for name in OPTIMIZERS), ("adagrad", 3), ("row_wise_adam", 3)]
)
def test_a_hot_id_across_chunks_equals_the_torch_path(
    name: str, chunk: int, interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs of one id span many chunks (3: nearly every run crosses one; 64: the default, the
    # hottest row's ~200 copies span several) and chunks lie wholly inside one run.
    config = FusedOptimizerConfig(name=name, lr=0.05, weight_decay=0.1, maximize=True)
    reference = _kernel(config, PoolingType.MEAN, "cpu")
    hottest = _train_hot(reference, 2)
    assert min(hottest) > 2 * 64
    update = functools.partial(interpreted.sparse_update, chunk=chunk)
    with monkeypatch.context() as patch:
        patch.setattr(RecoptTableBatchedEmbedding, "_triton_update_fn", lambda self, g: update)
        patch.setattr(updates, "apply_update", _must_not_run)
        with_triton = _kernel(config, PoolingType.MEAN, "cpu")
        _train_hot(with_triton, 2)
    _assert_same(with_triton, reference)


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the torch update ran; the Triton kernel should have")


def test_cpu_tables_never_take_the_triton_update() -> None:
    kernel = _kernel(FusedOptimizerConfig(name="adam"), PoolingType.SUM, "cpu")
    assert kernel._triton_update_fn(torch.zeros(1)) is None


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_recopt_kernel_on_cuda_uses_triton_and_equals_the_cpu_kernel(name: str) -> None:
    pytest.importorskip("triton")
    config = FusedOptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
    on_cpu, on_gpu = (
        _kernel(config, PoolingType.MEAN, "cpu"),
        _kernel(config, PoolingType.MEAN, "cuda"),
    )
    assert on_gpu._triton_update_fn(torch.zeros(1, device="cuda")) is not None
    on_gpu.grad_hook = lambda t, rows, grad: grad  # hooks need the torch path
    assert on_gpu._triton_update_fn(torch.zeros(1, device="cuda")) is None
    on_gpu.grad_hook = None
    with torch.no_grad():
        for src, dst in zip(
            on_cpu.split_embedding_weights(), on_gpu.split_embedding_weights(), strict=True
        ):
            dst.copy_(src)
    _train(on_cpu, True, 4)
    _train(on_gpu, True, 4)
    _assert_same(on_gpu, on_cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compiled_kernel_with_a_hot_id_equals_the_cpu_kernel(name: str) -> None:
    pytest.importorskip("triton")
    config = FusedOptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
    on_cpu = _kernel(config, PoolingType.SUM, "cpu")
    on_gpu = _kernel(config, PoolingType.SUM, "cuda")
    assert on_gpu._triton_update_fn(torch.zeros(1, device="cuda")) is not None
    with torch.no_grad():
        for src, dst in zip(
            on_cpu.split_embedding_weights(), on_gpu.split_embedding_weights(), strict=True
        ):
            dst.copy_(src)
    assert min(_train_hot(on_cpu, 2)) > 2 * 64  # the hottest row spans several chunks
    _train_hot(on_gpu, 2)
    _assert_same(on_gpu, on_cpu)


def test_the_triton_path_reads_nothing_back(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_host_syncs import count_read_backs, criteo_like

    from recopt.kernels.config import Backend
    from recopt.modules import FusedEmbeddingBagCollection

    monkeypatch.setattr(
        RecoptTableBatchedEmbedding, "_triton_update_fn", lambda self, g: interpreted.sparse_update
    )
    monkeypatch.setattr(updates, "apply_update", _must_not_run)
    tables, kjt = criteo_like()
    for name in ("row_wise_adagrad", "adam"):
        config = FusedOptimizerConfig(name=name, backend=Backend.RECOPT)
        ebc = FusedEmbeddingBagCollection(tables, optimizer=config, skip_nonfinite=False)
        for kernel in ebc.kernels():
            assert isinstance(kernel, RecoptTableBatchedEmbedding)
            kernel._use_native = False  # the path CUDA takes
        ebc(kjt).values().sum().backward()
        pooled = ebc(kjt)
        with count_read_backs() as calls:
            pooled.values().sum().backward()
        assert calls == [], calls
