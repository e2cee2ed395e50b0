"""The GPU tier: everything here needs CUDA and is skipped without it (marker ``cuda``).

CPU == CUDA for every fused optimizer and both backends after several steps (fbgemm's Adam and
LAMB against recopt's CPU kernel, also through a checkpoint each way); DMP at one rank
over NCCL (also NCCL alone, where the plan broadcast must move its CPU tensor); a checkpoint
GPU -> CPU -> GPU; the batch prefetcher; the DLRM script for a few steps. The multi-rank
contract on ranks sharing one GPU is in test_sharding_contract.py. AUTO is not pinned here
(tests/conftest.py): bf16 and weight-decay refusals, AUTO's choices for them and for LAMB, and
the memory a dropped fbgemm kernel frees are checked against the real kernels (issue 23).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pathlib
import sys
from typing import Any

import pytest
import torch
from torch import nn

from recopt.kernels import registry
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, InvalidIdError
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
OPTIMIZERS = list(registry.OPTIMIZERS)  # every fused optimizer


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=25, embedding_dim=16, feature_names=["b"]),
    ]


def _batch(step: int, num_bags: int = 6) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    bags = {
        "a": [torch.randint(0, 40, (int(n),), generator=g).tolist() for n in range(num_bags)],
        "b": [torch.randint(0, 25, (2,), generator=g).tolist() for _ in range(num_bags)],
    }
    return KeyedJaggedTensor.from_id_lists(bags)


def _fused(
    name: str,
    backend: Backend,
    device: torch.device,
    tables: list[EmbeddingBagConfig] | None = None,
    **options: Any,
) -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(name=name, lr=0.05, backend=backend, **options)
    try:
        return FusedEmbeddingBagCollection(tables or _tables(), optimizer=optimizer, device=device)
    except ValueError as err:
        if backend == Backend.FBGEMM and "not supported by the fbgemm backend" in str(err):
            pytest.skip(f"fbgemm has no {name!r} on {device.type}: {err}")
        raise


def _train(ebc: FusedEmbeddingBagCollection, steps: range) -> None:
    for step in steps:
        kjt = _batch(step).to(ebc.device)
        upstream = torch.randn(6, 24, generator=torch.Generator().manual_seed(step))
        (ebc(kjt).values() * upstream.to(ebc.device)).sum().backward()


def _assert_same(ebc: FusedEmbeddingBagCollection, ref: FusedEmbeddingBagCollection) -> None:
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ebc.state_dict()[key].cpu(), value.cpu(), atol=1e-6, rtol=1e-5)
    mine = ebc.fused_optimizer.state_dict()["state"]
    for param, states in ref.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            got = torch.as_tensor(mine[param][name]).cpu()
            torch.testing.assert_close(got, torch.as_tensor(value).cpu(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", [Backend.FBGEMM, Backend.RECOPT, Backend.AUTO])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_equals_cpu_after_several_steps(name: str, backend: Backend) -> None:
    on_gpu = _fused(name, backend, GPU)
    on_cpu = _fused(name, Backend.RECOPT, CPU)  # recopt's CPU kernel is the reference
    on_gpu.load_state_dict(on_cpu.state_dict())
    _train(on_gpu, range(4))
    _train(on_cpu, range(4))
    _assert_same(on_gpu, on_cpu)


def test_bad_id_on_cuda_raises_and_updates_nothing() -> None:
    ebc = _fused("adam", Backend.AUTO, GPU)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    bad = KeyedJaggedTensor.from_id_lists({"a": [[1, 40]], "b": [[3]]}).to(GPU)
    with pytest.raises(InvalidIdError, match="table 't0', feature 'a': id 40"):
        ebc(bad)
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key])


def test_checkpoint_gpu_to_cpu_to_gpu(tmp_path: pathlib.Path) -> None:
    from recopt.checkpoint import load, save

    gpu = _fused("row_wise_adam", Backend.AUTO, GPU)
    _train(gpu, range(3))
    save(tmp_path / "from_gpu", gpu, gpu.fused_optimizer)
    cpu = _fused("row_wise_adam", Backend.AUTO, CPU)
    load(tmp_path / "from_gpu", cpu, cpu.fused_optimizer)
    _assert_same(cpu, gpu)
    save(tmp_path / "from_cpu", cpu, cpu.fused_optimizer)
    again = _fused("row_wise_adam", Backend.AUTO, GPU)
    load(tmp_path / "from_cpu", again, again.fused_optimizer)
    _assert_same(again, gpu)
    _train(again, range(3, 5))  # and training continues identically
    _train(gpu, range(3, 5))
    _assert_same(again, gpu)


@pytest.mark.parametrize("name", ["adam", "row_wise_adam", "lamb", "row_wise_lamb"])
def test_fbgemm_cuda_stepped_checkpoint_resumes_on_recopts_cpu_kernel(
    name: str, tmp_path: pathlib.Path
) -> None:
    from recopt.checkpoint import load, save

    gpu = _fused(name, Backend.FBGEMM, GPU)
    assert {g["backend"] for g in gpu.fused_optimizer.param_groups} == {"fbgemm"}
    _train(gpu, range(3))
    steps = [v for s in gpu.fused_optimizer.state_dict()["state"].values() for k, v in s.items()]
    assert all(int(torch.as_tensor(v)) == 3 for v in steps if v.dim() == 0)
    save(tmp_path / "fbgemm_gpu", gpu, gpu.fused_optimizer)
    cpu = _fused(name, Backend.RECOPT, CPU)
    load(tmp_path / "fbgemm_gpu", cpu, cpu.fused_optimizer)
    _assert_same(cpu, gpu)
    _train(cpu, range(3, 6))  # recopt's CPU kernel continues as fbgemm's CUDA kernel does
    _train(gpu, range(3, 6))
    _assert_same(cpu, gpu)
    back = _fused(name, Backend.FBGEMM, GPU)  # and back: recopt's state into fbgemm's kernel
    save(tmp_path / "recopt_cpu", cpu, cpu.fused_optimizer)
    load(tmp_path / "recopt_cpu", back, back.fused_optimizer)
    _train(back, range(6, 8))
    _train(cpu, range(6, 8))
    _assert_same(back, cpu)


@pytest.mark.parametrize("name", ["lamb", "row_wise_lamb"])
def test_fbgemm_cuda_lamb_with_weight_decay_equals_recopts_cpu_kernel(name: str) -> None:
    """fbgemm's LAMB adds weight_decay * w to its direction, as recopt's does: no refusal."""
    modules = []
    for backend, device in ((Backend.FBGEMM, GPU), (Backend.RECOPT, CPU)):
        torch.manual_seed(0)
        optimizer = FusedOptimizerConfig(
            name=name, lr=0.05, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-4, backend=backend
        )
        modules.append(FusedEmbeddingBagCollection(_tables(), optimizer=optimizer, device=device))
    gpu, cpu = modules
    assert {g["backend"] for g in gpu.fused_optimizer.param_groups} == {"fbgemm"}
    gpu.load_state_dict(cpu.state_dict())
    _train(gpu, range(5))
    _train(cpu, range(5))
    _assert_same(gpu, cpu)


def test_fbgemm_cuda_adam_refuses_tables_with_different_steps() -> None:
    ebc = _fused("adam", Backend.FBGEMM, GPU)
    (kernel,) = ebc.kernels()
    states = kernel.split_optimizer_states()
    states[0]["step"].fill_(4)
    states[1]["step"].fill_(9)
    with pytest.raises(ValueError, match=r"'t0': 4, 't1': 9"):
        ebc(_batch(0).to(GPU))


class _Model(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sparse = _fused("row_wise_adagrad", Backend.AUTO, device)
        self.dense = nn.Linear(24, 1, device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).square().sum()


def _dmp_one_rank(rank: int, world_size: int) -> list[float]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    device = torch.device("cuda", torch.cuda.current_device())
    dmp = DistributedModelParallel(_Model(device), device=device)  # the planner's plan
    ref = _Model(device)
    dense = torch.optim.SGD(dmp.parameters(), lr=0.01)
    ref_dense = torch.optim.SGD(ref.dense.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        kjt = _batch(step).to(device)
        loss, ref_loss = dmp(kjt), ref(kjt)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        for opt, value in ((dense, loss), (ref_dense, ref_loss)):
            opt.zero_grad()
            value.backward()
            opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "nccl"])
def test_dmp_at_one_rank_over_nccl(backend: str) -> None:
    # NCCL alone: the planner's CPU-side broadcast goes through comm, which moves it.
    (losses,) = run_on_ranks(_dmp_one_rank, 1, backend=backend, timeout_s=240)
    assert len(losses) == 3


def test_prefetcher_hands_out_the_source_batches_and_its_position() -> None:
    from recopt.data import SyntheticClickLog, SyntheticConfig
    from recopt.data.prefetch import DevicePrefetcher

    def source() -> Any:
        config = SyntheticConfig(min_ids_per_bag=0, max_ids_per_bag=3)
        return SyntheticClickLog([("a", 1000), ("b", 50)], config, batch_size=64)

    fetched = DevicePrefetcher(source(), GPU)
    plain = source()
    for _ in range(3):
        got, want = next(fetched), next(plain)
        assert got.dense.device.type == "cuda" and got.position == want.position
        torch.testing.assert_close(got.dense.cpu(), want.dense)
        torch.testing.assert_close(got.sparse.values().cpu(), want.sparse.values())
        torch.testing.assert_close(got.labels.cpu(), want.labels)
        assert fetched.state_dict() == plain.state_dict()  # not the batch in flight


def test_dlrm_script_trains_a_few_steps_on_cuda(tmp_path: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train as dlrm_train

    out = tmp_path / "run"
    argv = [
        "--set", "training.steps=30",
        "--set", "training.log_every=10",
        "--set", f"training.output_dir={out}",
        "--set", "training.plot=false",
        "--set", "data.batch_size=256",
        "--set", "data.val_batches=2",
        "--set", "checkpoint.every=20",
    ]  # fmt: skip
    assert dlrm_train.main(argv) == 0
    assert (out / "metrics.jsonl").read_text().count('"split": "val"') >= 1


# issue 23: refusals and AUTO's choices with RECOPT_BACKEND unset, and freed memory ------------


def _backends(ebc: FusedEmbeddingBagCollection) -> set[tuple[str, str]]:
    return {(g["backend"], g["backend_reason"]) for g in ebc.fused_optimizer.param_groups}


def _bf16_tables() -> list[EmbeddingBagConfig]:
    return [dataclasses.replace(t, weight_dtype="bf16") for t in _tables()]


def test_auto_runs_bf16_on_recopt_and_fbgemm_refuses_bf16_even_in_uvm() -> None:
    from recopt.kernels.placement import Location, Placement

    assert os.environ.get("RECOPT_BACKEND") in (None, "auto")  # conftest leaves AUTO unpinned
    options = {"stochastic_rounding": False}
    gpu = _fused("row_wise_adagrad", Backend.AUTO, GPU, _bf16_tables(), **options)
    assert _backends(gpu) == {("recopt", "only candidate")}
    cpu = _fused("row_wise_adagrad", Backend.RECOPT, CPU, _bf16_tables(), **options)
    gpu.load_state_dict(cpu.state_dict())
    _train(gpu, range(3))
    _train(cpu, range(3))
    for key, value in cpu.state_dict().items():  # bf16: to a few of its 8 mantissa bits
        torch.testing.assert_close(gpu.state_dict()[key].cpu(), value, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="do not run bf16 weights"):
        _fused("row_wise_adagrad", Backend.FBGEMM, GPU, _bf16_tables())
    uvm = {"t0": Placement(location=Location.UVM)}
    with pytest.raises(ValueError, match="placed in UVM.*weight_dtype='fp16' or 'fp32'"):
        FusedEmbeddingBagCollection(
            _bf16_tables(),
            optimizer=FusedOptimizerConfig(name="row_wise_adagrad"),
            device=GPU,
            table_placements=uvm,
        )


@pytest.mark.parametrize("backend", [Backend.FBGEMM, Backend.AUTO])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_wise_adagrad"])
def test_weight_decay_on_cuda_equals_recopts_cpu_kernel_or_is_refused(
    name: str, backend: Backend
) -> None:
    """fbgemm's CUDA sgd and adagrad ignore weight_decay (refused; AUTO picks recopt); its
    row-wise adagrad applies recopt's L2 term (allowed, and equal)."""
    if backend is Backend.FBGEMM and name in ("sgd", "adagrad"):
        with pytest.raises(ValueError, match="ignores weight_decay"):
            _fused(name, backend, GPU, weight_decay=0.5)
        return
    gpu = _fused(name, backend, GPU, weight_decay=0.5)
    if name in ("sgd", "adagrad"):
        assert _backends(gpu) == {("recopt", "only candidate")}
    cpu = _fused(name, Backend.RECOPT, CPU, weight_decay=0.5)
    gpu.load_state_dict(cpu.state_dict())
    _train(gpu, range(4))
    _train(cpu, range(4))
    _assert_same(gpu, cpu)


@pytest.mark.parametrize("name", ["lamb", "row_wise_lamb"])
def test_auto_runs_lamb_on_recopt_where_fbgemm_writes_nan(name: str) -> None:
    """AUTO's objection to fbgemm's LAMB, and the behaviour behind it: a touched row whose
    summed gradient is zero on its first step (direction r = 0) becomes NaN on fbgemm's kernel
    and stays as it was on recopt's. Should fbgemm's kernel ever guard it, this test fails and
    the objection (registry: fbgemm_zero_direction_nan) can go."""
    assert ("recopt", "only candidate") in _backends(_fused(name, Backend.AUTO, GPU))
    kjt = KeyedJaggedTensor.from_id_lists({"a": [[3], [5]], "b": [[1], [2]]}).to(GPU)
    upstream = torch.ones(2, 24, device=GPU)
    upstream[0] = 0.0  # bag 0 alone holds row 3 of t0: its gradient is exactly zero
    rows = {}
    for backend in (Backend.FBGEMM, Backend.RECOPT):
        ebc = _fused(name, backend, GPU)
        before = ebc.state_dict()["embedding_bags.t0.weight"][3].clone()
        (ebc(kjt).values() * upstream).sum().backward()
        rows[backend] = (before, ebc.state_dict()["embedding_bags.t0.weight"][3])
    assert torch.isnan(rows[Backend.FBGEMM][1]).all()
    torch.testing.assert_close(rows[Backend.RECOPT][1], rows[Backend.RECOPT][0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["adam", "row_wise_adam", "lamb", "row_wise_lamb"])
def test_a_dropped_stepped_fbgemm_module_frees_its_gpu_memory_at_once(name: str) -> None:
    tables = [
        EmbeddingBagConfig(
            name="t0", num_embeddings=200_000, embedding_dim=64, feature_names=["a"]
        ),
        EmbeddingBagConfig(name="t1", num_embeddings=25, embedding_dim=16, feature_names=["b"]),
    ]
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(GPU)
    gc.disable()  # reference counting alone must free it
    try:
        ebc = _fused(name, Backend.FBGEMM, GPU, tables)
        assert _backends(ebc) == {("fbgemm", "explicit")}
        (ebc(_batch(0).to(GPU)).values()).sum().backward()
        held = torch.cuda.memory_allocated(GPU) - baseline
        assert held > 200_000 * 64 * 4 * 2  # weights and at least a first moment
        del ebc
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(GPU) - baseline < held // 100
    finally:
        gc.enable()
