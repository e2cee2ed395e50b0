"""Tests of the backend choice: `choose_backend`'s AUTO policy and its errors, `create_kernel`.

AUTO's measurement is tested in test_kernel_autotune.py; here fake timings make recopt the
faster on CPU, and CUDA is made unavailable (also on a GPU host), so it cannot be measured and
AUTO takes fbgemm, its reference, for CUDA kernels.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recopt.kernels.autotune import AutoConfig, AutoResolver, Sampler, configure_auto
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import choose_backend, create_kernel
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

CPU = torch.device("cpu")
TABLES = [
    TableSpec(name="t0", num_embeddings=40, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=7, embedding_dim=4),
]
FEATURE_TABLE_MAP = [0, 1, 0]  # features 0 and 2 share table 0


@pytest.fixture(autouse=True)
def _auto_measures_recopt_faster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def timings(*args: object) -> dict[Backend, Sampler]:
        return {Backend.FBGEMM: lambda: 0.002, Backend.RECOPT: lambda: 0.001}

    # On a GPU host AUTO would time CUDA kernels with the fake timings above (recopt faster)
    # instead of falling back to fbgemm, which is what these tests check for CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    previous = configure_auto(AutoResolver(AutoConfig(), timings, machine="test"))
    yield
    configure_auto(previous)


def test_choose_backend_policy_and_errors() -> None:
    adam = FusedOptimizerConfig(name="adam")
    assert choose_backend(TABLES, adam, CPU) == Backend.RECOPT
    # fbgemm's CUDA Adam runs SparseAdam's formula, but has no L2 weight decay.
    assert choose_backend(TABLES, adam, torch.device("cuda")) == Backend.FBGEMM
    decayed = FusedOptimizerConfig(name="adam", weight_decay=0.1)
    assert choose_backend(TABLES, decayed, torch.device("cuda")) == Backend.RECOPT
    rwa = FusedOptimizerConfig(name="row_wise_adagrad")
    assert choose_backend(TABLES, rwa, torch.device("cuda")) == Backend.FBGEMM
    for name in ("sgd", "adagrad", "row_wise_adagrad"):
        cfg = FusedOptimizerConfig(name=name)
        assert choose_backend(TABLES, cfg, CPU) == Backend.RECOPT  # the faster (fake timings)
    odd = [TableSpec(name="user_id", num_embeddings=10, embedding_dim=6)]
    assert choose_backend(odd, rwa, torch.device("cuda")) == Backend.RECOPT
    with pytest.raises(ValueError, match="'user_id'.*embedding_dim 6.*use 8"):
        choose_backend(odd, FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM), CPU)
    with pytest.raises(ValueError, match="'t0'.*'adam' is not supported.*backend='recopt'"):
        choose_backend(TABLES, FusedOptimizerConfig(name="adam", backend=Backend.FBGEMM), CPU)
    forced = FusedOptimizerConfig(name="sgd", backend=Backend.RECOPT)
    assert choose_backend(TABLES, forced, torch.device("cuda")) == Backend.RECOPT


def test_create_kernel_builds_recopt_and_validates() -> None:
    cfg = FusedOptimizerConfig(name="adam")
    kernel = create_kernel(TABLES, FEATURE_TABLE_MAP, cfg, PoolingType.SUM, CPU)
    assert isinstance(kernel, RecoptTableBatchedEmbedding)
    with pytest.raises(ValueError, match=r"feature_table_map\[1\] = 5"):
        create_kernel(TABLES, [0, 5], cfg, PoolingType.SUM, CPU)
    with pytest.raises(ValueError, match="tables is empty"):
        create_kernel([], [], cfg, PoolingType.SUM, CPU)


def test_maximize_never_goes_to_fbgemm() -> None:
    cfg = FusedOptimizerConfig(name="row_wise_adagrad", maximize=True)
    assert choose_backend(TABLES, cfg, torch.device("cuda")) == Backend.RECOPT
    assert choose_backend(TABLES, cfg, CPU) == Backend.RECOPT
    with pytest.raises(ValueError, match="maximize"):
        choose_backend(
            TABLES, FusedOptimizerConfig(name="sgd", maximize=True, backend=Backend.FBGEMM), CPU
        )


def test_shared_table_keeps_fbgemm_cpu_adagrad_away() -> None:
    rwa = FusedOptimizerConfig(name="row_wise_adagrad")
    assert choose_backend(TABLES, rwa, CPU, FEATURE_TABLE_MAP) == Backend.RECOPT
    assert choose_backend(TABLES, rwa, torch.device("cuda"), FEATURE_TABLE_MAP) == Backend.FBGEMM
    forced = FusedOptimizerConfig(name="adagrad", backend=Backend.FBGEMM)
    with pytest.raises(ValueError, match="'t0' is looked up by 2 features"):
        choose_backend(TABLES, forced, CPU, FEATURE_TABLE_MAP)
    sgd = FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM)
    assert choose_backend(TABLES, sgd, CPU, FEATURE_TABLE_MAP) == Backend.FBGEMM
