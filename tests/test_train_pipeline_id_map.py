"""Pipelined training with id-mapped tables in one process: batch i+1 remapped ahead.

The plain loop is the reference, exactly: outputs, weights, optimizer state and every map
buffer after the run, on the native remap (on the worker thread) and the torch path, for each
policy; a state_dict taken between steps, an evaluation, a load and a failing step in the
middle of the run give what the plain loop gives at the same point.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pipeline_helpers import (
    ID_MAP_POLICIES,
    NUM_TABLES,
    RAW_ROWS,
    Batches,
    TinyModel,
    fused_state,
    id_map_model,
    make_batch,
    pipelined_loop,
    plain_loop,
    raw_batch,
    same,
    tables,
)

from recopt.data.batch import Batch
from recopt.kernels import FusedOptimizerConfig
from recopt.modules import FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map import IdMap
from recopt.sharding import TrainPipelineSparseDist

POLICIES = {name: IdMapConfig(**kwargs) for name, kwargs in ID_MAP_POLICIES.items()}


def _live_buffers(model: TinyModel) -> list[torch.Tensor]:
    """The maps' buffers as they are (ahead steps included), not through state_dict: once
    the worker is done with them (a step ahead may still be writing them)."""
    maps = model.embedding_bags.id_maps
    maps.ahead.settle()
    return [b.clone() for name in maps for b in maps.table_map(name).buffers()]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_pipelined_id_maps_equal_the_plain_loop(policy: str, native: bool) -> None:
    if native and not IdMap(POLICIES[policy], RAW_ROWS)._native():
        pytest.skip("no C compiler: no native remap")
    batches = [raw_batch(i) for i in range(9)]
    model, optimizer = id_map_model(policy, native)
    expected, freed = [], 0.0
    for batch in batches:
        expected += plain_loop(model, optimizer, [batch])
        freed += sum(s["evictions"] + s["expired"] for s in model.embedding_bags.stats().values())
    expected_state, expected_stats = fused_state(model, optimizer), model.embedding_bags.stats()
    model, optimizer = id_map_model(policy, native)
    outputs = pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), Batches(batches))
    assert same(expected, outputs)
    assert same(expected_state, fused_state(model, optimizer))
    assert model.embedding_bags.stats() == expected_stats
    assert freed > 0  # the maps evicted (or expired) rows: fresh rows were reset


def _plain_states(policy: str, batches: list[Batch]) -> list[Any]:
    """The plain loop's state (state_dict order) and stats after each batch."""
    model, optimizer = id_map_model(policy, True)
    states = []
    for batch in batches:
        plain_loop(model, optimizer, [batch])
        states.append((fused_state(model, optimizer), model.embedding_bags.stats()))
    return states


def _steps(pipeline: TrainPipelineSparseDist, data: Iterator[Batch], count: int) -> list[Any]:
    return [pipeline.progress(data) for _ in range(count)]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_state_dict_between_steps_is_the_plain_loops(policy: str) -> None:
    """While batch i+1 is remapped ahead, state_dict and stats() are batch i's (the live
    maps keep the ahead step), and training goes on unchanged."""
    batches = [raw_batch(i) for i in range(8)]
    reference = _plain_states(policy, batches)
    model, optimizer = id_map_model(policy, True)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(batches)
    for step in range(len(batches)):
        pipeline.progress(data)
        live = _live_buffers(model)
        assert same(reference[step][0], fused_state(model, optimizer)), step
        assert model.embedding_bags.stats() == reference[step][1], step
        assert same(live, _live_buffers(model))  # state_dict left the ahead step alone
    assert len(model.embedding_bags.id_maps.ahead) == 0  # drained: nothing ahead


def test_eval_and_load_between_steps() -> None:
    """An evaluation between steps reads the maps as the plain loop has them (the ahead step
    is undone, then remapped again); a load between steps replaces the ahead step."""
    batches = [raw_batch(i) for i in range(8)]
    probe = raw_batch(50)
    model, optimizer = id_map_model("lfu", True)
    expected_eval = []
    for batch in batches[:5]:
        plain_loop(model, optimizer, [batch])
        model.eval()
        with torch.no_grad():
            expected_eval.append(model(probe)[1])
        model.train()
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    fused_checkpoint = copy.deepcopy(model.embedding_bags.fused_optimizer.state_dict())
    plain_loop(model, optimizer, batches[5:])
    expected_state = fused_state(model, optimizer)

    model, optimizer = id_map_model("lfu", True)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(batches)
    for step in range(5):
        pipeline.progress(data)
        model.eval()
        with torch.no_grad():
            assert same(expected_eval[step], model(probe)[1]), step
        model.train()
    # a load (here: of the state it has) between steps: the ahead step is replaced by it
    model.load_state_dict(checkpoint)
    model.embedding_bags.fused_optimizer.load_state_dict(fused_checkpoint)
    _steps(pipeline, data, 3)
    assert same(expected_state, fused_state(model, optimizer))


def test_a_bad_batch_ahead_raises_at_its_own_step() -> None:
    """A bad id of batch i+1 is found when it is remapped ahead but raised at its own step;
    batch i trains, no map moves for the bad batch, the next batches train."""
    batches = [raw_batch(i, bad_id=i == 3) for i in range(7)]
    model, optimizer = id_map_model("lru", True)
    expected = plain_loop(model, optimizer, batches)
    expected_state = fused_state(model, optimizer)
    model, optimizer = id_map_model("lru", True)
    outputs = pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), Batches(batches))
    assert outputs[3] == "InvalidIdError" == expected[3]
    assert same(expected, outputs)
    assert same(expected_state, fused_state(model, optimizer))


class _FailsOnce(TinyModel):
    """Raises before its collection's forward on the batch of ``fail_at`` labels' sum."""

    fail_next = False

    def forward(self, batch: Batch) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise ValueError("model failed before its embeddings")
        return super().forward(batch)


def test_a_step_failing_before_the_collection_leaves_no_map_step() -> None:
    """Batch i's remap ran ahead, but its forward failed before the collection: the map
    steps of batch i (and of batch i+1, ahead) are undone, as if batch i never came."""
    batches = [raw_batch(i) for i in range(7)]
    model, optimizer = id_map_model("lfu", True)
    expected = plain_loop(model, optimizer, batches[:3] + batches[4:])
    expected_state = fused_state(model, optimizer)
    model, optimizer = id_map_model("lfu", True)
    failing = _FailsOnce(model.embedding_bags)
    failing.top = model.top
    pipeline = TrainPipelineSparseDist(failing, optimizer, "cpu")
    data = Batches(batches)
    outputs = _steps(pipeline, data, 3)
    failing.fail_next = True
    with pytest.raises(ValueError, match="before its embeddings"):
        pipeline.progress(data)
    outputs += pipelined_loop(pipeline, data)
    assert same(expected, outputs)
    assert same(expected_state, fused_state(failing, optimizer))


@pytest.mark.parametrize("targets_replaced", [False, True], ids=["planned", "replanned"])
def test_the_forward_runs_the_reset_the_worker_planned(
    targets_replaced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker works out each step's fresh-row reset (`ResetPlan`) and the forward runs
    that plan; a plan made for other weights and states than the module's now (its kernel
    views made again) is made again at the forward. Either way the plain loop's result."""
    from recopt.modules.id_map_rows import ResetPlan

    batches = [raw_batch(i) for i in range(6)]
    model, optimizer = id_map_model("lru", True)
    plain_loop(model, optimizer, batches)
    expected = fused_state(model, optimizer)
    model, optimizer = id_map_model("lru", True)
    ebc = model.embedding_bags
    made_here: list[ResetPlan] = []
    ran: list[ResetPlan] = []
    start, run = FusedEmbeddingBagCollection.start_remap, ResetPlan.run

    def start_remap(self: FusedEmbeddingBagCollection, *args: Any, **kwargs: Any) -> Any:
        remap = start(self, *args, **kwargs)
        if remap is not None:
            remap.settle()
            made_here.append(remap.reset_plan)
            if targets_replaced:
                self._fresh_targets = None  # the forward finds other targets than planned
        return remap

    def record(plan: ResetPlan, maps: Any) -> None:
        ran.append(plan)
        run(plan, maps)

    monkeypatch.setattr(FusedEmbeddingBagCollection, "start_remap", start_remap)
    monkeypatch.setattr(ResetPlan, "run", record)
    pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), Batches(batches))
    assert same(expected, fused_state(model, optimizer))
    assert len(ran) == len(batches) and all(p is not None for p in made_here)
    used = [plan for plan in ran if any(plan is made for made in made_here)]
    assert len(used) == (0 if targets_replaced else len(batches))
    assert all(plan.targets is ebc._reset_targets() for plan in ran[-1:])


def test_the_worker_makes_fresh_values_only_while_it_has_time() -> None:
    from recopt.modules.id_map_ahead import AheadRemap
    from recopt.modules.id_map_stage import WorkerLoad

    load = WorkerLoad(weight=1.0)  # the newest measurement alone
    assert load.fill_fits(0.001)  # never measured: try it once
    done = AheadRemap(raw_batch(0).sparse, 0, busy_s=0.008, fill_s=0.001)
    load.record(done)
    assert load.fill_fits(0.011)  # 9 ms of work in a 11 ms step: under 90%
    assert not load.fill_fits(0.009)  # a worker that would outlast the step hashes nothing
    load.record(AheadRemap(raw_batch(1).sparse, 0, busy_s=0.004))  # values made at the forward
    assert load.fill_s == 0.001 and load.fill_fits(0.009)  # the last fill time is kept


def test_phase_seconds_count_the_remap_workers_time() -> None:
    """``remap_worker``: the worker thread's busy time, in a pipeline whose maps step ahead on
    it (the native remap), absent from one without id maps; reset with the other phases."""
    if not IdMap(POLICIES["lru"], RAW_ROWS)._native():
        pytest.skip("no C compiler: the maps step inline, no worker")
    model, optimizer = id_map_model("lru", True)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches([raw_batch(i) for i in range(6)])
    _steps(pipeline, data, 4)
    assert pipeline.timed_steps == 4 and pipeline.phase_seconds["remap_worker"] > 0
    pipeline.reset_phase_seconds()
    assert "remap_worker" not in pipeline.phase_seconds
    _steps(pipeline, data, 2)
    assert pipeline.phase_seconds["remap_worker"] > 0
    plain = FusedEmbeddingBagCollection(tables(), FusedOptimizerConfig(name="sgd", lr=0.1))
    model = TinyModel(plain)
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    _steps(pipeline, Batches([make_batch(0, i) for i in range(4)]), 3)
    assert pipeline.timed_steps == 3 and "remap_worker" not in pipeline.phase_seconds


@pytest.mark.parametrize("policy", ["lru", "admit2-ttl"])
def test_maps_on_the_host_remap_from_the_batchs_host_copy(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Maps kept on the host (a CUDA collection's) remap a pipelined batch from its host copy
    (the batch before its copy to the GPU): ids read and checked there, the rows applied to
    the batch the forward gets. Here a copy on CPU stands for the host one, and the mapped
    ids of the batch the forward gets are overwritten: only rows from the host copy give
    the plain loop's results (a bad id, found in the host copy, raises at its own step)."""
    batches = [raw_batch(i, bad_id=i == 4) for i in range(9)]
    model, optimizer = id_map_model(policy, True)
    expected = plain_loop(model, optimizer, batches)
    expected_state = fused_state(model, optimizer)
    model, optimizer = id_map_model(policy, True)
    ebc = model.embedding_bags
    for name in ebc.id_maps:
        ebc.id_maps.table_map(name).on_host = True
    start_remap = ebc.start_remap
    started = []

    def from_a_host_copy(features: Any, threads: int | None = 1, host: Any = None) -> Any:
        assert host is None  # a CPU pipeline has no host copy of its own
        host = copy.deepcopy(features)
        features.values()[: features.offset_per_key()[NUM_TABLES - 1]] = 7  # mapped ids
        started.append(host)
        return start_remap(features, threads, host)

    monkeypatch.setattr(ebc, "start_remap", from_a_host_copy)
    outputs = pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), Batches(batches))
    assert outputs[4] == "InvalidIdError" == expected[4]
    assert same(expected, outputs)
    assert same(expected_state, fused_state(model, optimizer))
    assert len(started) == len(batches)
