"""TrainPipelineSparseDist on 2 and 3 gloo ranks equals the plain loop exactly.

Every sharding type (from `ShardingType`) and a mixed plan, fused optimizers, the non-finite
gate, variable batch per feature, a bad id in batch i+1, a retried (uncommitted) step, eval
mode, an embedding collection, and a resumed pipelined run vs an uninterrupted one: each
compares outputs (losses, logits), weights and optimizer state after every batch was trained.
All cases of a world size run in one spawned group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_helpers import (
    NUM_TABLES,
    Batches,
    TinyModel,
    UnpooledModel,
    dmp_state,
    failed_cases,
    make_batch,
    pipelined_loop,
    plain_loop,
    same,
    tables,
)
from sharding_requests import requests_for

from recopt.sharding.plan import ShardingType

KINDS = [*(kind.value for kind in ShardingType), "mixed"]  # every sharding type, and a mix
NUM_BATCHES = 6
# Fused optimizers of the mixed plan, table by table (one kernel group each).
MIXED_OPTIMIZERS = ["adagrad", "sgd", "row_wise_adagrad", "adam"]


def _requests(kind: str, world: int, optimizers: list[str] | None) -> dict[str, Any]:
    from recopt.kernels import FusedOptimizerConfig

    def opt(i: int) -> Any:
        if optimizers is None:
            return None
        return FusedOptimizerConfig(name=optimizers[i % len(optimizers)], lr=0.05)

    return requests_for(kind, world, NUM_TABLES, opt)


def _build(world: int, case: dict[str, Any]) -> tuple[Any, Any]:
    """A DMP-sharded TinyModel (same initial weights every call) and its dense optimizer."""
    from recopt.kernels import FusedOptimizerConfig
    from recopt.modules import EmbeddingBagCollection
    from recopt.sharding import (
        DistributedModelParallel,
        ShardingPlan,
        construct_module_sharding_plan,
    )

    if case.get("unpooled"):
        return _build_unpooled(world, case)
    torch.manual_seed(0)
    dense = case.get("dense", True)
    model = TinyModel(EmbeddingBagCollection(tables()), dense=dense)
    requests = _requests(case["kind"], world, case.get("optimizers"))
    plan = ShardingPlan(
        {"embedding_bags": construct_module_sharding_plan(tables(), requests, world)}
    )
    dmp = DistributedModelParallel(
        model, plan, default_optimizer=FusedOptimizerConfig(name="adagrad", lr=0.1)
    )
    optimizer = torch.optim.SGD(dmp.parameters(), lr=0.1) if dense else None
    return dmp, optimizer


def _build_unpooled(world: int, case: dict[str, Any]) -> tuple[Any, Any]:
    from recopt.kernels import FusedOptimizerConfig
    from recopt.sharding import (
        DistributedModelParallel,
        ShardingPlan,
        construct_module_sharding_plan,
    )

    torch.manual_seed(0)
    requests = _requests(case["kind"], world, None)
    plan = ShardingPlan({"embeddings": construct_module_sharding_plan(tables(), requests, world)})
    optimizer = FusedOptimizerConfig(name="adagrad", lr=0.1)
    return DistributedModelParallel(
        UnpooledModel(tables()), plan, default_optimizer=optimizer
    ), None


def _batches(rank: int, case: dict[str, Any]) -> list[Any]:
    bad = case.get("bad_id")  # (rank, batch)
    nan = case.get("nan_label")
    return [
        make_batch(
            rank,
            i,
            bad_id=bad == (rank, i),
            nan_label=nan == (rank, i),
            vbe=case.get("vbe", False),
        )
        for i in range(NUM_BATCHES)
    ]


def _compare(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    from recopt.sharding import TrainPipelineSparseDist

    batches = _batches(rank, case)
    reference = list(batches)
    retry = case.get("retry")
    calls = [0]

    def committed() -> bool:  # the step of batch ``retry`` is kept and trained once more
        calls[0] += 1
        return calls[0] != retry + 1

    if retry is not None:
        reference.insert(retry, batches[retry])
    model, optimizer = _build(world, case)
    expected = plain_loop(model, optimizer, reference)
    expected_state = dmp_state(model, optimizer)
    skipped = model.skipped_nonfinite_steps
    model, optimizer = _build(world, case)
    pipeline = TrainPipelineSparseDist(
        model, optimizer, "cpu", step_committed=None if retry is None else committed
    )
    outputs = pipelined_loop(pipeline, Batches(batches))
    result = {
        "outputs": same(expected, outputs),
        "state": same(expected_state, dmp_state(model, optimizer)),
        "skipped": skipped == model.skipped_nonfinite_steps,
        "position": pipeline.data_state() == {"position": NUM_BATCHES},
    }
    if case.get("nan_label") is not None:
        result["gate_skipped_once"] = skipped == 1
    if case.get("bad_id") is not None:
        bad_rank, bad_batch = case["bad_id"]
        error = "InvalidIdError" if rank == bad_rank else "RemoteInputError"
        result["raised_at_its_step"] = expected[bad_batch] == error == outputs[bad_batch]
    return result


def _eval(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    from recopt.sharding import EvalPipelineSparseDist

    batches = _batches(rank, case)
    model, _ = _build(world, case)
    before = dmp_state(model, None)
    with torch.no_grad():
        expected = [model(b)[1] for b in batches]
    outputs = pipelined_loop(EvalPipelineSparseDist(model, "cpu"), Batches(batches))
    return {"outputs": same(expected, outputs), "unchanged": same(before, dmp_state(model, None))}


def _resume(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """Checkpoint after 3 pipelined steps (the iterator is 2 batches ahead), resume in a new
    model and pipeline: the end state equals an uninterrupted pipelined run's."""
    from recopt.checkpoint import load, save
    from recopt.sharding import TrainedPosition, TrainPipelineSparseDist

    batches = _batches(rank, case)
    model, optimizer = _build(world, case)
    data = Batches(batches)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    first = [pipeline.progress(data) for _ in range(3)]
    ahead = data.position
    path = Path(tmp) / f"resume-{world}"
    extra = {"data": TrainedPosition(pipeline, data)}
    save(path, model, {"dense": optimizer, "fused": model.fused_optimizer}, extra=extra)
    uninterrupted = first + pipelined_loop(pipeline, data)
    expected_state = dmp_state(model, optimizer)

    model, optimizer = _build(world, case)
    data = Batches(batches)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    extra = {"data": TrainedPosition(pipeline, data)}
    load(path, model, {"dense": optimizer, "fused": model.fused_optimizer}, extra=extra)
    resumed = first + pipelined_loop(pipeline, data)
    return {
        "iterator_was_ahead": ahead == 5,
        "outputs": same(uninterrupted, resumed),
        "state": same(expected_state, dmp_state(model, optimizer)),
    }


RUNNERS = {"compare": _compare, "eval": _eval, "resume": _resume}


def _cases(world: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = [{"kind": kind} for kind in KINDS]
    if world == 2:
        cases += [
            {"kind": "mixed", "optimizers": MIXED_OPTIMIZERS},
            {"kind": "row_wise", "optimizers": ["row_wise_adagrad"]},
            {"kind": "mixed", "dense": False, "nan_label": (0, 2)},
            {"kind": "mixed", "vbe": True},
            {"kind": "mixed", "bad_id": (1, 3)},
            {"kind": "mixed", "unpooled": True, "bad_id": (0, 2)},
            {"kind": "mixed", "retry": 2},
            {"kind": "mixed", "runner": "eval"},
            {"kind": "mixed", "runner": "resume", "optimizers": MIXED_OPTIMIZERS},
        ]
    else:
        cases += [{"kind": "mixed", "bad_id": (2, 1)}]
    return cases


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_training_equals_the_plain_loop(world: int, tmp_path: Path) -> None:
    failures = failed_cases(RUNNERS, world, _cases(world), str(tmp_path))
    assert not failures, failures
