"""Id maps on CUDA (GPU tier, marker ``cuda``; skipped without a GPU).

A CUDA collection keeps its maps in host memory, where the native remap steps them (the ids
come over, the rows go back: `recopt.modules.id_map.map_device`); a map built on CUDA itself
runs the torch ops. Here the CUDA map is compared with the CPU reference step by step on
drifting raw ids (every buffer, every row, the fresh rows), its undo record restores it bit
for bit, a fused collection with id-mapped tables trains on CUDA like the same collection on
CPU (both backends) with its maps on the host, and the pipeline (batch i+1 remapped ahead on
the worker) equals the plain loop on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_helpers import (
    NUM_TABLES,
    Batches,
    TinyModel,
    fused_state,
    pipelined_loop,
    plain_loop,
    raw_batch,
    raw_tables,
    same,
)

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map import IdMap, map_device
from recopt.sharding import TrainPipelineSparseDist
from recopt.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda", 0)
CONFIGS = [
    IdMapConfig(policy="lru"),
    IdMapConfig(policy="lfu", decay=0.9),
    IdMapConfig(policy="lru", ttl_steps=2),
    IdMapConfig(policy="lfu", admit_after=2, candidate_slots=8),
]


def _ids(step: int, size: int = 40) -> torch.Tensor:
    """Raw ids of a drifting power law: a popular head that moves, and a long tail."""
    gen = torch.Generator().manual_seed(step)
    rank = (torch.rand(size, generator=gen) ** 3 * 60).long() + 3 * step
    return rank * 2**35 - 11


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: repr(c))
def test_cuda_map_equals_cpu_map_step_by_step(config: IdMapConfig) -> None:
    cpu, gpu = IdMap(config, 16, "cpu"), IdMap(config, 16, GPU)
    evictions = 0
    for step in range(12):
        ids = _ids(step)
        want = cpu.remap(ids, True)
        got = gpu.remap(ids.to(GPU), True)
        assert torch.equal(got.rows_M.cpu(), want.rows_M), step
        assert torch.equal(got.fresh_rows.cpu(), want.fresh_rows), step
        assert torch.equal(got.fresh_ids.cpu(), want.fresh_ids), step
        assert got.stats == want.stats, step
        for name, value in cpu.state_dict().items():
            assert torch.equal(gpu.state_dict()[name].cpu(), value), (step, name)
        evictions += want.stats.evictions
        read = gpu.remap(_ids(step + 100).to(GPU), False)  # eval: reads only
        assert torch.equal(read.rows_M.cpu(), cpu.remap(_ids(step + 100), False).rows_M)
    assert evictions > 0  # the maps were full


def test_cuda_undo_restores_the_map_bit_for_bit() -> None:
    idmap = IdMap(IdMapConfig(policy="lfu", decay=0.8, admit_after=2), 12, GPU)
    for step in range(5):
        idmap.remap(_ids(step).to(GPU), True)
    before = {k: v.clone() for k, v in idmap.state_dict().items()}
    result = idmap.remap(_ids(5).to(GPU), True, record_undo=True)
    assert result.undo is not None
    idmap.apply_undo(result.undo)
    for name, value in before.items():
        assert torch.equal(idmap.state_dict()[name], value), name


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t0",
            num_embeddings=24,
            embedding_dim=8,
            feature_names=["a"],
            id_map=IdMapConfig(policy="lru", admit_after=2),
        ),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=16,
            embedding_dim=16,
            feature_names=["b"],
            id_map=IdMapConfig(policy="lfu"),
        ),
        EmbeddingBagConfig(name="t2", num_embeddings=10, embedding_dim=8, feature_names=["c"]),
    ]


def _batch(step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(1000 + step)
    raw = _ids(step, 60).view(6, 10)
    return KeyedJaggedTensor.from_id_lists(
        {
            "a": [raw[i, : 1 + i % 4].tolist() for i in range(6)],
            "b": [raw[i, 4:6].tolist() for i in range(6)],
            "c": [torch.randint(0, 10, (2,), generator=gen).tolist() for _ in range(6)],
        }
    )


@pytest.mark.parametrize("backend", [Backend.RECOPT, Backend.FBGEMM])
def test_fused_id_mapped_collection_on_cuda_equals_cpu(backend: Backend) -> None:
    config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, backend=backend)
    cpu_config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, backend=Backend.RECOPT)
    torch.manual_seed(0)
    on_cpu = FusedEmbeddingBagCollection(_tables(), optimizer=cpu_config)
    on_gpu = FusedEmbeddingBagCollection(_tables(), optimizer=config, device=GPU)
    on_gpu.load_state_dict(on_cpu.state_dict())
    assert on_gpu.id_maps is not None
    on_gpu.to(GPU)  # a move leaves the maps where their remap runs
    home = map_device(GPU)
    assert {b.device for b in on_gpu.id_maps.buffers()} == {home}
    evictions = 0.0
    for step in range(8):
        upstream = torch.randn(6, 32, generator=torch.Generator().manual_seed(step))
        want = on_cpu(_batch(step)).values()
        got = on_gpu(_batch(step).to(GPU)).values()
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
        (want * upstream).sum().backward()
        (got * upstream.to(GPU)).sum().backward()
        assert on_gpu.stats() == on_cpu.stats(), step
        evictions += sum(s["evictions"] for s in on_cpu.stats().values())
    for key, value in on_cpu.state_dict().items():
        torch.testing.assert_close(on_gpu.state_dict()[key].cpu(), value, atol=1e-5, rtol=1e-4)
    assert evictions > 0  # the maps were full


def _gpu_model() -> tuple[TinyModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.3, backend=Backend.RECOPT)
    id_maps = [IdMapConfig(policy="lfu", decay=0.9), IdMapConfig(policy="lru", admit_after=2)]
    tables = raw_tables((id_maps * NUM_TABLES)[:NUM_TABLES])
    model = TinyModel(FusedEmbeddingBagCollection(tables, optimizer, device=GPU)).to(GPU)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _map_buffers(model: TinyModel) -> list[torch.Tensor]:
    """Every map buffer as it is (on the host), once the worker is done with them."""
    maps = model.embedding_bags.id_maps
    maps.ahead.settle()
    return [b.clone() for b in maps.buffers()]


def test_pipelined_cuda_id_maps_equal_the_plain_loop() -> None:
    batches = [raw_batch(i) for i in range(9)]
    model, optimizer = _gpu_model()
    expected, freed = [], 0.0
    for batch in batches:
        expected += plain_loop(model, optimizer, [batch.to(GPU)])
        freed += sum(s["evictions"] for s in model.embedding_bags.stats().values())
    expected_state, expected_stats = fused_state(model, optimizer), model.embedding_bags.stats()
    expected_maps = _map_buffers(model)
    model, optimizer = _gpu_model()
    pipeline = TrainPipelineSparseDist(model, optimizer, GPU)
    outputs = pipelined_loop(pipeline, Batches(batches))
    # The maps (int64, float64 counters, stats) exactly; floats up to the CUDA kernels' order.
    torch.testing.assert_close(outputs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_state(model, optimizer), expected_state, rtol=1e-5, atol=1e-6)
    assert same(_map_buffers(model), expected_maps)
    assert model.embedding_bags.stats() == expected_stats
    assert freed > 0  # the maps evicted rows: fresh rows were reset on the GPU
