"""Resuming reduced-precision training rounds exactly as the run that never stopped.

The stochastic-rounding randomness of a pass is a function of the kernel's seed and its
tables' ``rounding_step`` counters, which checkpoints keep. Tiers: the seed function, one
kernel whose state is copied (the native pass and torch ops), a fused collection through
checkpoint save and load, checkpoints without counters (older ones, fbgemm's) in both
directions, then two ranks of a sharded collection.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import full_state
from test_host_syncs import count_read_backs
from test_precision_checkpoint import Model, batch, plan
from torch import nn

from recopt.checkpoint import load, read_manifest, save
from recopt.kernels import cpu_fused
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import KernelOwner
from recopt.kernels.precision import RoundingStream, pass_seed
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

CPU = torch.device("cpu")
# (weight dtype, state dtype): every combination that rounds something stochastically.
PRECISIONS = [
    ("fp16", "fp32"),
    ("bf16", "fp32"),
    ("fp16", "fp16"),
    ("bf16", "bf16"),
    ("fp32", "bf16"),
]
PATHS = ["native", "torch", "torch_no_library"]


def test_pass_seed_is_a_pure_function_of_base_and_pass() -> None:
    seeds = {pass_seed(base, n) for base in range(4) for n in range(50)}
    assert len(seeds) == 200  # no collisions between neighbouring bases and passes
    assert all(0 <= s < 2**63 for s in seeds)
    assert pass_seed(3, 17) == pass_seed(3, 17)
    stream, again = RoundingStream(3, CPU), RoundingStream(3, CPU)
    stream.begin_pass(5)
    first = torch.rand(4, generator=stream.generator)
    torch.rand(9, generator=again.generator)  # a stream drawn elsewhere before the pass
    assert again.begin_pass(5) == pass_seed(3, 5)
    assert torch.equal(torch.rand(4, generator=again.generator), first)


# One kernel -------------------------------------------------------------------------------


@contextmanager
def _path(path: str) -> Iterator[None]:
    """Run the native pass, torch ops (native rounding), or torch ops with no native library."""
    if path == "native" and not cpu_fused.available():
        pytest.skip("no C compiler: the native pass is not built")
    original = cpu_fused.available
    if path == "torch_no_library":
        cpu_fused.available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_fused.available = original  # type: ignore[assignment]


def _kernel(
    weights: str, state: str, path: str, seed: int = 0, device: torch.device = CPU
) -> RecoptTableBatchedEmbedding:
    torch.manual_seed(seed)
    tables = [
        TableSpec(name="a", num_embeddings=30, embedding_dim=8, weight_dtype=weights),
        TableSpec(name="b", num_embeddings=20, embedding_dim=4, weight_dtype=weights),
    ]
    config = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3, state_dtype=state)
    return RecoptTableBatchedEmbedding(
        tables, [0, 1, 0], config, PoolingType.SUM, device, use_native=path == "native"
    )


def _batches(
    count: int, device: torch.device = CPU
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
        ids = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(5, 20, generator=gen)
        out.append((ids.to(device), offsets.to(device), grad.to(device)))
    return out


def _tensors(kernel: RecoptTableBatchedEmbedding) -> list[torch.Tensor]:
    states = kernel.split_optimizer_states()
    return [*kernel.split_embedding_weights(), *(v for s in states for v in s.values())]


def _copy(
    src: RecoptTableBatchedEmbedding, dst: RecoptTableBatchedEmbedding, counters: bool
) -> None:
    """What a checkpoint load does: every weight and state written in place."""
    with torch.no_grad():
        for a, b in zip(src.split_embedding_weights(), dst.split_embedding_weights(), strict=True):
            b.copy_(a)
        for a, b in zip(src.split_optimizer_states(), dst.split_optimizer_states(), strict=True):
            for key, value in a.items():
                if counters or key != "rounding_step":
                    b[key].copy_(value)


def _train(kernel: RecoptTableBatchedEmbedding, batches: list[Any]) -> None:
    for ids, offsets, grad in batches:
        kernel(ids, offsets).backward(grad)


def _train_without_reads(kernel: RecoptTableBatchedEmbedding, batches: list[Any]) -> list[str]:
    """`_train` with each feature's bounds given (as a KJT gives them): the reads it made."""
    bounds = [offsets[:: grad.shape[0]].tolist() for _, offsets, grad in batches]
    with count_read_backs() as calls:
        for (ids, offsets, grad), keys in zip(batches, bounds, strict=True):
            kernel(ids, offsets, None, keys).backward(grad)
    return calls


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("weights", "state"), PRECISIONS)
def test_kernel_continued_from_copied_state_is_bit_identical(
    weights: str, state: str, path: str
) -> None:
    batches = _batches(6)
    with _path(path):
        unbroken = _kernel(weights, state, path)
        _train(unbroken, batches)
        first = _kernel(weights, state, path)
        _train(first, batches[:3])
        resumed, stale = (
            _kernel(weights, state, path, seed=5),
            _kernel(weights, state, path, seed=5),
        )
        _copy(first, resumed, counters=True)
        _copy(first, stale, counters=False)  # as if the counters were not saved
        ids, offsets, grad = batches[3]
        if path == "native" and state == "fp32":
            assert resumed._native_ok(grad, ids, offsets, None)
        _train(resumed, batches[3:])
        _train(stale, batches[3:])
    for a, b in zip(_tensors(unbroken), _tensors(resumed), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert [int(s["rounding_step"]) for s in resumed.split_optimizer_states()] == [6, 6]
    # The counters carry the stream: restarted at 0, the same steps round otherwise.
    assert not all(
        torch.equal(a, b) for a, b in zip(_tensors(unbroken), _tensors(stale), strict=True)
    )


def test_a_kernel_whose_tables_disagree_rounds_with_the_largest_count() -> None:
    ids, offsets, grad = _batches(1)[0]
    behind, level = _kernel("fp16", "fp32", "torch"), _kernel("fp16", "fp32", "torch")
    for kernel, counts in ((behind, (3, 7)), (level, (7, 7))):
        with torch.no_grad():
            for state, count in zip(kernel.split_optimizer_states(), counts, strict=True):
                state["rounding_step"].fill_(count)
    _train(behind, [(ids, offsets, grad)])
    _train(level, [(ids, offsets, grad)])
    assert [int(s["rounding_step"]) for s in behind.split_optimizer_states()] == [4, 8]
    for a, b in zip(behind.split_embedding_weights(), level.split_embedding_weights(), strict=True):
        assert torch.equal(a, b)


def test_only_tables_rounded_stochastically_keep_a_counter() -> None:
    tables = [
        TableSpec(name="a", num_embeddings=4, embedding_dim=4, weight_dtype="fp16"),
        TableSpec(name="b", num_embeddings=4, embedding_dim=4),
    ]
    for config, expected in (
        (FusedOptimizerConfig(name="sgd"), [True, False]),
        (FusedOptimizerConfig(name="adam", state_dtype="bf16"), [True, True]),
        (FusedOptimizerConfig(name="sgd", stochastic_rounding=False), [False, False]),
    ):
        kernel = RecoptTableBatchedEmbedding(tables, [0, 1], config, PoolingType.SUM, CPU)
        has = ["rounding_step" in s for s in kernel.split_optimizer_states()]
        assert has == expected, config


def test_torch_path_reads_back_nothing_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a GPU runs: the counters' host copies advance without a read, the stream is
    # reseeded on the host; only a write from outside (a load) costs one read.
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    kernel = _kernel("fp16", "bf16", "torch")
    batches = _batches(3)
    assert _train_without_reads(kernel, batches[:2]) == []
    with torch.no_grad():
        kernel.split_optimizer_states()[0]["rounding_step"].fill_(9)
    calls = _train_without_reads(kernel, batches[2:])
    assert len(calls) == 1 and "recopt/kernels/steps.py" in calls[0], calls


@pytest.mark.cuda
def test_cuda_resume_is_bit_identical_and_fbgemm_keeps_its_counters() -> None:
    cuda = torch.device("cuda")
    batches = _batches(4, cuda)
    unbroken, first = (
        _kernel("fp16", "bf16", "torch", 0, cuda),
        _kernel("fp16", "bf16", "torch", 0, cuda),
    )
    _train(unbroken, batches)
    _train(first, batches[:2])
    resumed = _kernel("fp16", "bf16", "torch", 5, cuda)
    _copy(first, resumed, counters=True)
    _train(resumed, batches[2:])
    for a, b in zip(_tensors(unbroken), _tensors(resumed), strict=True):
        assert torch.equal(a, b)
    pytest.importorskip("fbgemm_gpu")
    from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding

    tables = [
        TableSpec(name=n, num_embeddings=20, embedding_dim=8, weight_dtype="fp16") for n in "ab"
    ]
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05)
    kernel = FbgemmTableBatchedEmbedding(tables, [0, 1, 0], config, PoolingType.SUM, cuda)
    for ids, offsets, _ in batches[:2]:
        kernel(ids, offsets).backward(torch.randn(5, 24, device=cuda))
    assert [int(s["rounding_step"]) for s in kernel.split_optimizer_states()] == [2, 2]


# A fused collection through checkpoints -------------------------------------------------


def _use_torch_ops(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, KernelOwner):
            for kernel in module.kernels():
                if isinstance(kernel, RecoptTableBatchedEmbedding):
                    kernel._use_native = False


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("state", ["fp32", "fp16", "bf16"])
def test_collection_saved_loaded_and_continued_equals_the_unbroken_run(
    tmp_path: Path, state: str, path: str
) -> None:
    with _path(path):
        unbroken, first, resumed = (Model(state=state) for _ in range(3))
        if path == "torch":
            for model in (unbroken, first, resumed):
                _use_torch_ops(model)
        for step in range(5):
            unbroken(batch(0, step)).backward()
        for step in range(3):
            first(batch(0, step)).backward()
        save(tmp_path / "ck", first, first.sparse.fused_optimizer, step=3)
        load(tmp_path / "ck", resumed, resumed.sparse.fused_optimizer)
        for step in range(3, 5):
            resumed(batch(0, step)).backward()
    expected = full_state(unbroken, unbroken.sparse.fused_optimizer)
    assert _identical(full_state(resumed, resumed.sparse.fused_optimizer), expected) == []
    counters = {k: int(v) for k, v in expected.items() if k.endswith("rounding_step")}
    # t2 is fp32: it rounds (and counts) only when its state is reduced.
    assert len(counters) == (2 if state == "fp32" else 3) and set(counters.values()) == {5}


def _collection(stochastic: bool, backend: str = "recopt") -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=rows,
            embedding_dim=8,
            feature_names=(f"f{i}",),
            weight_dtype=w,
        )
        for i, (rows, w) in enumerate(((11, "fp16"), (13, "fp16"), (7, "fp32")))
    ]
    config = FusedOptimizerConfig(
        name="row_wise_adagrad", lr=0.05, stochastic_rounding=stochastic, backend=backend
    )
    return FusedEmbeddingBagCollection(tables, optimizer=config)


def _kjt(step: int) -> KeyedJaggedTensor:
    from checkpoint_helpers import random_batch

    return random_batch({"f0": 11, "f1": 13, "f2": 7}, 0, step)


def _train_collection(ebc: FusedEmbeddingBagCollection, steps: range) -> None:
    for step in steps:
        ebc(_kjt(step)).values().square().mean().backward()


def _counters(ebc: FusedEmbeddingBagCollection) -> dict[str, int]:
    return {
        key: int(value)
        for states in ebc.fused_optimizer.state_dict()["state"].values()
        for key, value in states.items()
        if key.endswith("rounding_step")
    }


@pytest.mark.parametrize("backend", ["recopt", "fbgemm"])
def test_checkpoints_without_counters_load_as_zero_and_excess_ones_are_dropped(
    tmp_path: Path, backend: str
) -> None:
    # Rounding to nearest keeps no counter: its checkpoints are laid out like those saved
    # before counters existed, and like fbgemm's CPU kernels' (which round to nearest).
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    nearest = _collection(stochastic=False, backend=backend)
    _train_collection(nearest, range(2))
    save(tmp_path / "old", nearest, nearest.fused_optimizer)
    assert not [k for k in read_manifest(tmp_path / "old").tensors if "rounding_step" in k]
    rounded = _collection(stochastic=True)
    _train_collection(rounded, range(3))
    assert set(_counters(rounded).values()) == {3}
    load(tmp_path / "old", rounded, rounded.fused_optimizer)
    assert set(_counters(rounded).values()) == {0} and len(_counters(rounded)) == 2
    loaded = full_state(rounded, rounded.fused_optimizer)
    saved = full_state(nearest, nearest.fused_optimizer)
    assert _identical({k: loaded[k] for k in saved}, saved) == []
    _train_collection(rounded, range(3, 4))  # counts on from 0
    assert set(_counters(rounded).values()) == {1}
    # And back: the counters of a stochastic checkpoint are dropped by a model without them.
    save(tmp_path / "new", rounded, rounded.fused_optimizer)
    load(tmp_path / "new", nearest, nearest.fused_optimizer)
    assert _counters(nearest) == {}
    loaded = full_state(nearest, nearest.fused_optimizer)
    saved = full_state(rounded, rounded.fused_optimizer)
    assert _identical(loaded, {k: v for k, v in saved.items() if k in loaded}) == []


def test_optimizer_state_dict_moves_between_configurations_in_memory() -> None:
    rounded, nearest = _collection(stochastic=True), _collection(stochastic=False)
    _train_collection(rounded, range(2))
    nearest.fused_optimizer.load_state_dict(rounded.fused_optimizer.state_dict())
    rounded.fused_optimizer.load_state_dict(nearest.fused_optimizer.state_dict())
    assert set(_counters(rounded).values()) == {0}


# Two ranks ------------------------------------------------------------------------------


def _resume_on_ranks(rank: int, world: int, root: str) -> list[str]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    problems = []
    for state, path in (("fp32", "native"), ("bf16", "native"), ("fp16", "torch")):

        def build(state: str = state, path: str = path) -> Any:
            dmp = DistributedModelParallel(Model(state=state), plan("mixed", world))
            if path == "torch":
                _use_torch_ops(dmp)
            return dmp

        unbroken, first, resumed = build(), build(), build()
        for step in range(4):
            unbroken(batch(rank, step)).backward()
        for step in range(2):
            first(batch(rank, step)).backward()
        directory = Path(root) / f"ck_{state}_{path}"
        save(directory, first, first.fused_optimizer, step=2)
        load(directory, resumed, resumed.fused_optimizer)
        for step in range(2, 4):
            resumed(batch(rank, step)).backward()
        expected = full_state(unbroken, unbroken.fused_optimizer)
        got = full_state(resumed, resumed.fused_optimizer)
        problems += [f"{state}/{path}: {k}" for k in _identical(got, expected)]
        counters = {k: int(v) for k, v in got.items() if k.endswith("rounding_step")}
        if not counters or set(counters.values()) != {4}:
            problems.append(f"{state}/{path}: counters {counters}")
    # fp32 state saved no counter for the fp32 table t2 (table-wise on rank 0: rank 1 mirrors
    # it); loaded into bf16 state, where t2 counts, it restarts at 0 on both ranks.
    bf16 = DistributedModelParallel(Model(state="bf16"), plan("mixed", world))
    for step in range(3):
        bf16(batch(rank, step)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp32 state converted to bf16
        load(Path(root) / "ck_fp32_native", bf16, bf16.fused_optimizer)
    got = full_state(bf16, bf16.fused_optimizer)
    counters = {k: int(v) for k, v in got.items() if k.endswith("rounding_step")}
    if counters != {
        f"sparse.embedding_bags.t{t}.weight/t{t}.rounding_step": n
        for t, n in ((0, 2), (1, 2), (2, 0))
    }:
        problems.append(f"fp32 -> bf16 state: counters {counters}")
    return problems


@pytest.mark.multiprocess
def test_sharded_collection_resumes_bit_identically_on_two_ranks(tmp_path: Path) -> None:
    for rank_problems in run_on_ranks(_resume_on_ranks, 2, str(tmp_path), timeout_s=270):
        assert rank_problems == []
