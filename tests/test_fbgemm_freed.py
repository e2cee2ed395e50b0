"""Dropped fbgemm kernels and AUTO's probe kernels free their memory at once (issue 23, defect 3).

A stepped fbgemm kernel (CUDA adam, row-wise adam, lamb, row-wise lamb) once held itself through
its step bookkeeping (`FbgemmSteps` kept a bound method of the kernel), so only the cyclic
collector freed it: a 40 GB Adam module stayed allocated while the next one was built. Here the
collector is off while a kernel is dropped; a weak reference shows whether reference counting
alone freed it. fbgemm's CPU build has no stepped optimizer, so the stepped kernel's bookkeeping
runs around fbgemm's CPU SGD kernel (its counters and ``eps`` mapping are what is checked).
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from recopt.kernels import fbgemm_backend
from recopt.kernels.autotune import AutoConfig, AutoResolver, Sampler, ShapeClass
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import create_kernel
from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding, build_fbgemm_tbe
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

CPU = torch.device("cpu")
BUILD_FBGEMM_TBE = build_fbgemm_tbe  # the real one, before a test replaces it
TABLES = [
    TableSpec(name="t0", num_embeddings=30, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=20, embedding_dim=4),
]


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off: only reference counting frees objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _step(kernel: torch.nn.Module) -> None:
    ids = torch.tensor([1, 5, 7, 2, 19, 3])
    offsets = torch.tensor([0, 2, 3, 5, 6])  # 2 bags a feature
    kernel(ids, offsets).backward(torch.ones(2, 12))


def _sgd_kernel_for(
    tables: Sequence[TableSpec],
    feature_table_map: Sequence[int],
    optimizer: FusedOptimizerConfig,
    pooling: PoolingType,
    device: torch.device,
) -> Any:
    """fbgemm's CPU SGD kernel standing in for a CUDA-only optimizer's."""
    sgd = FusedOptimizerConfig(name="sgd", lr=optimizer.lr, eps=optimizer.eps)
    return BUILD_FBGEMM_TBE(tables, feature_table_map, sgd, pooling, device)


def _dropped_is_freed(make: Callable[[], torch.nn.Module]) -> bool:
    kernel = make()
    _step(kernel)
    _step(kernel)
    ref = weakref.ref(kernel)
    del kernel
    return ref() is None


@pytest.mark.usefixtures("no_collector")
def test_a_dropped_fbgemm_kernel_is_freed_without_the_collector() -> None:
    sgd = FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM)
    assert _dropped_is_freed(lambda: create_kernel(TABLES, [0, 1], sgd, PoolingType.SUM, CPU))


@pytest.mark.usefixtures("no_collector")
def test_a_dropped_fused_collection_on_fbgemm_is_freed_without_the_collector() -> None:
    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["a"])
    ]
    sgd = FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM)
    module = FusedEmbeddingBagCollection(tables, optimizer=sgd)
    module(KeyedJaggedTensor.from_id_lists({"a": [[1, 2], [3]]})).values().sum().backward()
    refs = [weakref.ref(module), *(weakref.ref(k) for k in module.kernels())]
    assert [type(k).__name__ for k in module.kernels()] == ["FbgemmTableBatchedEmbedding"]
    del module
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("name", ["adam", "row_wise_adam", "lamb", "row_wise_lamb"])
def test_a_dropped_stepped_fbgemm_kernel_is_freed_without_the_collector(
    name: str, monkeypatch: pytest.MonkeyPatch, no_collector: None
) -> None:
    monkeypatch.setattr(fbgemm_backend, "build_fbgemm_tbe", _sgd_kernel_for)
    monkeypatch.setattr(fbgemm_backend, "fbgemm_problems", lambda *args: [])  # CUDA-only names
    optimizer = FusedOptimizerConfig(name=name, betas=(0.9, 0.99), eps=1e-3)

    def make() -> torch.nn.Module:
        return FbgemmTableBatchedEmbedding(TABLES, [0, 1], optimizer, PoolingType.SUM, CPU)

    kernel = make()
    _step(kernel)
    _step(kernel)
    buffers = dict(kernel.named_buffers())
    assert [int(buffers[f"_step_{t}"]) for t in range(2)] == [2, 2]  # advanced by each backward
    # fbgemm's counters were set to recopt's 1 before the second forward (its SGD adds nothing).
    assert int(kernel._tbe.iter) == int(kernel._tbe.iter_cpu) == 1
    remapped = 1e-3 / math.sqrt(1 - 0.99**2)  # SparseAdam's eps for step 2 (adam only)
    expected = remapped if "adam" in name else 1e-3
    assert kernel._tbe.optimizer_args.eps == pytest.approx(expected)
    del kernel, buffers
    assert _dropped_is_freed(make)


class _Cyclic:
    """A probe's stand-in that only the collector can free (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.usefixtures("no_collector")
def test_autos_probe_kernels_are_freed_once_measured() -> None:
    probes: list[weakref.ref[_Cyclic]] = []

    def factory(
        shape: ShapeClass,
        optimizer: FusedOptimizerConfig,
        candidates: Sequence[Backend],
        config: AutoConfig,
    ) -> Mapping[Backend, Sampler]:
        samplers = {}
        for n, backend in enumerate(candidates):
            probe = _Cyclic()
            probes.append(weakref.ref(probe))
            samplers[backend] = lambda probe=probe, n=n: 0.001 * (n + 1) + 0 * id(probe)
        return samplers

    resolver = AutoResolver(AutoConfig(repeats=3), factory, machine="m")
    shape = ShapeClass.of(TABLES, FusedOptimizerConfig(name="row_wise_adagrad"), CPU)
    decision = resolver.resolve(shape, FusedOptimizerConfig(), [Backend.FBGEMM, Backend.RECOPT])
    assert (decision.backend, decision.reason) == (Backend.FBGEMM, "measured")
    assert len(probes) == 2 and all(ref() is None for ref in probes)
