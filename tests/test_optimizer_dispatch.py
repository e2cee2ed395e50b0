"""A fused optimizer is its spec: every dispatcher (C, Triton, torch) reads it, and refuses a
code or a name it has no update for instead of running another optimizer's.

A test optimizer registered for the duration of a test ("sgd_twin": sgd's spec and update under
another name) shows that a new optimizer with native code is a spec entry plus its update; the
same registration without the C case, the Triton branch or the torch function is an error that
says where to add it.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from recopt.kernels import cpu_fused, registry, updates
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.precision import Precision
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

TWIN = "sgd_twin"
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def _register(monkeypatch: pytest.MonkeyPatch, **facts: object) -> None:
    spec = dataclasses.replace(registry.SGD, name=TWIN, **facts)  # type: ignore[arg-type]
    monkeypatch.setitem(registry.OPTIMIZERS, TWIN, spec)


def _train(name: str, native: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    tables = [TableSpec(name="t0", num_embeddings=10, embedding_dim=8)]
    config = FusedOptimizerConfig(name=name, lr=0.1)
    kernel = RecoptTableBatchedEmbedding(tables, [0], config, PoolingType.SUM, "cpu")
    kernel._use_native = native
    ids = torch.tensor([1, 3, 3, 7])
    offsets = torch.tensor([0, 2, 4])
    for _ in range(2):
        kernel(ids, offsets, None).backward(torch.ones(2, 8))
    return [w.detach().clone() for w in kernel.split_embedding_weights()]


def test_every_spec_has_one_torch_update() -> None:
    for name, spec in registry.OPTIMIZERS.items():
        table_rule = name in updates._TABLE_UPDATES
        assert table_rule == spec.whole_table_statistics, name
        assert (name in updates._UPDATES) != table_rule, name


def test_triton_branches_are_the_specs_codes() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from recopt.kernels import triton_sparse

    codes = {s.c_code for s in registry.OPTIMIZERS.values() if s.triton_update}
    assert codes == set(triton_sparse.CODES)


@pytest.mark.parametrize("native", NATIVE)
def test_a_new_optimizer_is_a_spec_entry_plus_its_update(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    if native and not cpu_fused.available():
        pytest.skip("the native library did not build here")
    _register(monkeypatch)
    monkeypatch.setitem(updates._UPDATES, TWIN, updates._UPDATES["sgd"])
    reference = _train("sgd", native)
    twin = _train(TWIN, native)
    assert not torch.equal(twin[0], torch.zeros_like(twin[0]))
    torch.testing.assert_close(twin, reference, rtol=0, atol=0)


def test_a_native_code_without_a_c_case_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_fused.available():
        pytest.skip("the native library did not build here")
    _register(monkeypatch, c_code=7, triton_update=False)
    monkeypatch.setitem(updates._UPDATES, TWIN, updates._UPDATES["sgd"])
    with pytest.raises(ValueError, match="code 7 has no case in update_row"):
        _train(TWIN, native=True)


def test_a_code_without_a_triton_branch_is_an_error() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from recopt.kernels import triton_sparse

    weight = torch.zeros(4, 8)
    ids = torch.tensor([1, 2])
    args = (ids, ids * 8, None, torch.ones(16), weight, None, None)
    with pytest.raises(ValueError, match="code 7 has no branch in recopt/kernels/triton_sparse"):
        triton_sparse.sparse_update(7, *args, (0.1, 1e-8, 0.0, 1.0, 0.1, 0.001), 0.0)
    assert torch.equal(weight, torch.zeros(4, 8))


def test_a_spec_without_a_torch_update_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch, c_code=None, triton_update=False)
    with pytest.raises(ValueError, match="'sgd_twin' has no torch update: register"):
        _train(TWIN, native=False)


def test_triton_update_needs_a_native_code() -> None:
    with pytest.raises(ValueError, match="triton_update needs a c_code"):
        dataclasses.replace(registry.SGD, c_code=None)


def test_config_rules_come_from_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch, eps_pair=True, fp32_state_only=True)
    config = FusedOptimizerConfig(name=TWIN, eps=(1e-30, 1e-3))
    assert (config.eps, config.eps2) == (1e-30, 1e-3)
    with pytest.raises(ValueError, match="sgd_twin reduces its statistics"):
        FusedOptimizerConfig(name=TWIN, state_dtype=Precision.BF16)
    with pytest.raises(ValueError, match="only adafactor and sgd_twin take"):
        FusedOptimizerConfig(name="adam", eps=(1e-30, 1e-3))


def test_a_backend_without_a_kernel_class_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from recopt.kernels import backends
    from recopt.kernels.config import Backend
    from recopt.kernels.factory import create_kernel

    tables = [TableSpec(name="t0", num_embeddings=10, embedding_dim=8)]
    config = FusedOptimizerConfig(name="sgd", backend=Backend.RECOPT)
    kernel = create_kernel(tables, [0], config, PoolingType.SUM, torch.device("cpu"))
    assert isinstance(kernel, backends.KERNEL_CLASSES[Backend.RECOPT])
    monkeypatch.delitem(backends.KERNEL_CLASSES, Backend.RECOPT)
    with pytest.raises(
        ValueError, match="backend 'recopt' has no kernel class; known: \\['fbgemm'\\]"
    ):
        create_kernel(tables, [0], config, PoolingType.SUM, torch.device("cpu"))
