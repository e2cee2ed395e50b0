"""TrainPipelineSparseDist in one process: the same loop without sharded collections.

The plain loop is the reference (outputs, weights, optimizer state, exactly); the pipeline fills
and drains itself for any number of batches, and says what to do when it cannot find or match
the model's sparse input. One case runs a sharded model on one rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from pipeline_helpers import (
    Batches,
    TinyModel,
    dmp_state,
    fused_state,
    make_batch,
    pipelined_loop,
    plain_loop,
    same,
    tables,
)

from recopt.data.batch import Batch
from recopt.kernels import FusedOptimizerConfig
from recopt.modules import FusedEmbeddingBagCollection
from recopt.sharding import EvalPipelineSparseDist, TrainPipelineSparseDist
from recopt.sharding.train_pipeline import default_sparse_input
from recopt.testing import run_on_ranks


def _model() -> tuple[TinyModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    embedding = FusedEmbeddingBagCollection(tables(), FusedOptimizerConfig(name="adam", lr=0.05))
    model = TinyModel(embedding)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("num_batches", [0, 1, 2, 3, 7])
def test_one_process_pipeline_equals_the_plain_loop(num_batches: int) -> None:
    batches = [make_batch(0, i) for i in range(num_batches)]
    model, optimizer = _model()
    expected = plain_loop(model, optimizer, batches)
    expected_state = fused_state(model, optimizer)
    model, optimizer = _model()
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(batches)
    outputs = pipelined_loop(pipeline, data)
    assert len(outputs) == num_batches  # the last batches are trained when the data ends
    assert same(expected, outputs)
    assert same(expected_state, fused_state(model, optimizer))
    with pytest.raises(StopIteration):  # and it stays ended
        pipeline.progress(data)
    assert pipeline.timed_steps == num_batches
    trained = None if num_batches == 0 else {"position": num_batches}
    assert pipeline.data_state() == trained


def test_eval_pipeline_runs_forward_only() -> None:
    batches = [make_batch(0, i) for i in range(4)]
    model, optimizer = _model()
    before = fused_state(model, optimizer)
    with torch.no_grad():
        expected = [model(b)[1] for b in batches]
    outputs = pipelined_loop(EvalPipelineSparseDist(model, "cpu"), Batches(batches))
    assert same(expected, outputs)
    assert same(before, fused_state(model, optimizer))


class _NoSparse(NamedTuple):
    dense: torch.Tensor


def test_a_batch_without_a_sparse_input_names_the_fix() -> None:
    with pytest.raises(ValueError, match="sparse_input="):
        default_sparse_input(_NoSparse(torch.zeros(1)))
    batch = make_batch(0, 0)
    assert default_sparse_input(batch) is batch.sparse


class _Rebuilds(TinyModel):
    """Passes its sharded collection a copy of the batch's sparse input."""

    def forward(self, batch: Batch) -> Any:
        copied = batch.sparse.to("cpu", non_blocking=False)
        sparse = type(copied)(keys=copied.keys(), values=copied.values(), lengths=copied.lengths())
        return super().forward(batch._replace(sparse=sparse))


def _sharded(cls: type[TinyModel], id_map: bool = False) -> tuple[Any, torch.optim.Optimizer]:
    from recopt.modules import EmbeddingBagCollection, IdMapConfig
    from recopt.sharding import DistributedModelParallel

    torch.manual_seed(0)
    configs = tables()
    if id_map:
        configs = [dataclasses.replace(t, id_map=IdMapConfig(policy="lru")) for t in configs]
    dmp = DistributedModelParallel(cls(EmbeddingBagCollection(configs)))
    return dmp, torch.optim.SGD(dmp.parameters(), lr=0.1)


def _one_rank(rank: int, world: int) -> dict[str, Any]:
    batches = [make_batch(rank, i) for i in range(5)]
    model, optimizer = _sharded(TinyModel)
    expected = plain_loop(model, optimizer, batches)
    expected_state = dmp_state(model, None)
    model, optimizer = _sharded(TinyModel)
    outputs = pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), iter(batches))
    equal = same(expected, outputs) and same(expected_state, dmp_state(model, None))
    result: dict[str, Any] = {"equal": equal, "rebuilds": None, "id_map": None}
    model, optimizer = _sharded(_Rebuilds)
    try:
        TrainPipelineSparseDist(model, optimizer, "cpu").progress(iter(batches))
    except ValueError as e:
        result["rebuilds"] = str(e)
    model, optimizer = _sharded(TinyModel, id_map=True)
    expected = plain_loop(model, optimizer, batches)
    expected_state = dmp_state(model, None)
    model, optimizer = _sharded(TinyModel, id_map=True)
    outputs = pipelined_loop(TrainPipelineSparseDist(model, optimizer, "cpu"), iter(batches))
    result["id_map"] = same(expected, outputs) and same(expected_state, dmp_state(model, None))
    return result


@pytest.mark.multiprocess
def test_one_rank_sharded_and_a_model_that_rebuilds_its_input() -> None:
    (result,) = run_on_ranks(_one_rank, 1)
    assert result["equal"] is True
    # The model gives its sharded collection another object than the one distributed ahead:
    # the pipeline says so and what to do.
    assert "another KeyedJaggedTensor" in result["rebuilds"]
    assert "sparse_input" in result["rebuilds"]
    # Id-mapped tables remap when their batch is distributed ahead: the plain loop's result.
    assert result["id_map"] is True
