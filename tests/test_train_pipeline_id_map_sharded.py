"""Pipelined training with sharded id-mapped tables on 2 and 3 gloo ranks: the plain loop, exactly.

Batch i+1's raw ids are distributed ahead (before batch i's forward); their owner shards map
them in batch i+1's own forward. Each case compares the pipelined run with the plain loop:
outputs, weights, optimizer state and every map buffer (state_dict) after the run; after every
step; with an evaluation between steps (the batch distributed ahead then trains, not
evaluates); with a checkpoint saved mid-run and resumed in a new model; a bad id in a batch
distributed ahead; a batch whose forward fails before the collection; an embedding
collection; under fault tolerance's guard, a dropped step rolled back and trained again; a
batch trained in eval mode and loads that leave the maps out. The
tables: table-wise, row-wise and table-row-wise id-mapped (lru, lfu, admission with ttl), beside
a column-wise unmapped table. All cases of a world size run in one spawned group.
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
    pipelined_loop,
    plain_loop,
    raw_batch,
    raw_tables,
    same,
)

NUM_BATCHES = 7
PLANS = {  # per table (the last, unmapped, column-wise)
    "mixed": ["table_wise", "row_wise", "table_row_wise", "column_wise"],
    "row_wise": ["row_wise", "row_wise", "row_wise", "column_wise"],
}


def _id_maps() -> list[Any]:
    from recopt.modules import IdMapConfig

    return [
        IdMapConfig(policy="lru"),
        IdMapConfig(policy="lfu", decay=0.9),
        IdMapConfig(policy="lru", admit_after=2, ttl_steps=3),
    ]


def _requests(plan: str, world: int) -> dict[str, Any]:
    from recopt.sharding import column_wise, row_wise, table_row_wise, table_wise

    makers = {
        "table_wise": lambda i: table_wise(i % world),
        "row_wise": lambda i: row_wise(),
        "table_row_wise": lambda i: table_row_wise(0),
        "column_wise": lambda i: column_wise(list(range(world))),
    }
    return {f"t{i}": makers[kind](i) for i, kind in enumerate(PLANS[plan])}


def _build(world: int, case: dict[str, Any]) -> tuple[Any, Any]:
    """A DMP-sharded model (the same initial weights every call) and its dense optimizer."""
    from recopt.kernels import FusedOptimizerConfig
    from recopt.modules import EmbeddingBagCollection
    from recopt.sharding import (
        DistributedModelParallel,
        ShardingPlan,
        construct_module_sharding_plan,
    )

    torch.manual_seed(0)
    configs = raw_tables(_id_maps())
    requests = _requests(case.get("plan", "mixed"), world)
    optimizer = FusedOptimizerConfig(name=case.get("optimizer", "row_wise_adagrad"), lr=0.2)
    if case.get("unpooled"):
        plan = ShardingPlan(
            {"embeddings": construct_module_sharding_plan(configs, requests, world)}
        )
        return DistributedModelParallel(
            UnpooledModel(configs), plan, default_optimizer=optimizer
        ), None
    model = TinyModel(EmbeddingBagCollection(configs))
    plan = ShardingPlan(
        {"embedding_bags": construct_module_sharding_plan(configs, requests, world)}
    )
    dmp = DistributedModelParallel(model, plan, default_optimizer=optimizer)
    return dmp, torch.optim.SGD(dmp.parameters(), lr=0.1)


def _stats(model: Any) -> dict[str, Any]:
    return {
        path: module.stats()
        for path, module in model.named_modules()
        if hasattr(module, "stats") and hasattr(module, "id_maps")
    }


def _batches(rank: int, case: dict[str, Any]) -> list[Any]:
    bad = case.get("bad_id")  # (rank, batch)
    return [raw_batch(i, rank, bad_id=bad == (rank, i)) for i in range(NUM_BATCHES)]


def _compare(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """The whole run, and after every step: state_dict, stats and (``eval``) an evaluation."""
    from recopt.sharding import TrainPipelineSparseDist

    batches = _batches(rank, case)
    probe = raw_batch(40, rank)

    def evaluated(model: Any) -> Any:
        if not case.get("eval"):
            return None
        model.eval()
        with torch.no_grad():
            output = model(probe)[1]
        model.train()
        return output

    model, optimizer = _build(world, case)
    expected, after_steps = [], []
    for batch in batches:
        expected += plain_loop(model, optimizer, [batch])
        after_steps.append((dmp_state(model, optimizer), _stats(model), evaluated(model)))
    freed = sum(
        s["evictions"] + s["expired"] for stats in _stats(model).values() for s in stats.values()
    )
    model, optimizer = _build(world, case)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(batches)
    outputs, steps_equal = [], []
    for state, stats, evaluation in after_steps:
        outputs += pipelined_loop_steps(pipeline, data, 1)
        steps_equal.append(
            same(state, dmp_state(model, optimizer))
            and stats == _stats(model)
            and same(evaluation, evaluated(model))
        )
    result = {
        "outputs": same(expected, outputs),
        "every_step": all(steps_equal),
        "drained": pipelined_loop(pipeline, data) == [],
        "evicted": freed > 0 or case.get("bad_id") is not None,
    }
    if case.get("bad_id") is not None:
        bad_rank, bad_batch = case["bad_id"]
        error = "InvalidIdError" if rank == bad_rank else "RemoteInputError"
        result["raised_at_its_step"] = expected[bad_batch] == error == outputs[bad_batch]
    return result


def pipelined_loop_steps(pipeline: Any, data: Any, count: int) -> list[Any]:
    """``count`` steps of `pipelined_loop`'s kind (a step that raises is recorded)."""
    outputs: list[Any] = []
    for _ in range(count):
        try:
            outputs.append(pipeline.progress(data))
        except ValueError as e:
            outputs.append(type(e).__name__)
    return outputs


def _resume(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """A checkpoint after 3 pipelined steps (batch 4's map step pending), resumed in a new
    model and pipeline: the end state equals the uninterrupted run's and the plain loop's."""
    from recopt.checkpoint import load, save
    from recopt.sharding import TrainedPosition, TrainPipelineSparseDist

    batches = _batches(rank, case)
    model, optimizer = _build(world, case)
    plain_loop(model, optimizer, batches)
    expected_state = dmp_state(model, optimizer)

    model, optimizer = _build(world, case)
    data = Batches(batches)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    first = pipelined_loop_steps(pipeline, data, 3)
    path = Path(tmp) / f"resume-{world}-{case.get('plan')}"
    optimizers = {"dense": optimizer, "fused": model.fused_optimizer}
    save(path, model, optimizers, extra={"data": TrainedPosition(pipeline, data)})
    uninterrupted = first + pipelined_loop(pipeline, data)
    uninterrupted_state = dmp_state(model, optimizer)

    model, optimizer = _build(world, case)
    data = Batches(batches)
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    optimizers = {"dense": optimizer, "fused": model.fused_optimizer}
    load(path, model, optimizers, extra={"data": TrainedPosition(pipeline, data)})
    resumed = first + pipelined_loop(pipeline, data)
    return {
        "outputs": same(uninterrupted, resumed),
        "state": same(uninterrupted_state, dmp_state(model, optimizer)),
        "plain": same(expected_state, uninterrupted_state),
    }


def _guarded(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """Fault tolerance's guard on the maps (its observers see every map step and reset): the
    pipeline trains as the plain loop does; a step dropped after its update (the guard rolls
    back rows, states and maps) and trained again (the pipeline keeps its batch and its
    distributed ids) ends as if it had never been dropped."""
    from recopt.ft.embedding import FusedEmbeddingGuard
    from recopt.sharding import ShardedEmbeddingBagCollection, TrainPipelineSparseDist

    def guarded() -> tuple[Any, Any, Any]:
        model, optimizer = _build(world, case)
        sharded = next(m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection))
        return model, optimizer, FusedEmbeddingGuard(sharded)

    batches = _batches(rank, case)
    model, optimizer, guard = guarded()
    expected = []
    for batch in batches:
        guard.on_start()
        expected += plain_loop(model, optimizer, [batch])
        guard.on_commit()
    expected_state = dmp_state(model, optimizer)
    model, optimizer, guard = guarded()
    answers = iter([True, True, False] + [True] * len(batches))  # the third step dropped
    dense = [p for group in optimizer.param_groups for p in group["params"]]
    before: list[torch.Tensor] = []

    def start() -> None:  # (a manager's wrapper would not step the dense optimizer instead)
        guard.on_start()
        before[:] = [p.detach().clone() for p in dense]

    def step_committed() -> bool:
        committed = next(answers)
        if committed:
            guard.on_commit()
        else:
            guard.on_abort()
            with torch.no_grad():
                for p, saved in zip(dense, before, strict=True):
                    p.copy_(saved)
        start()
        return committed

    start()
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu", step_committed=step_committed)
    outputs = pipelined_loop(pipeline, Batches(batches))
    dropped = outputs.pop(2)  # the dropped attempt's output, the retried one's after it
    return {
        "outputs": same(expected, outputs),
        "dropped_equal_retried": same(dropped, outputs[2]),
        "state": same(expected_state, dmp_state(model, optimizer)),
    }


def _fails_before(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """Batch 3's map step ran ahead (its ids mapped by their owners during batch 2's
    backward), but its forward fails on every rank before the sharded collection: the step is
    undone, as if batch 3 never came (the plain loop without it)."""
    from recopt.sharding import TrainPipelineSparseDist

    batches = _batches(rank, case)
    model, optimizer = _build(world, case)
    expected = plain_loop(model, optimizer, batches[:3] + batches[4:])
    expected_state = dmp_state(model, optimizer)
    model, optimizer = _build(world, case)
    real_forward = model.forward
    seen = {"n": 0}

    def forward(batch: Any) -> Any:
        seen["n"] += 1
        if seen["n"] == 4:  # batch 3: before the embeddings
            raise ValueError("model failed before its embeddings")
        return real_forward(batch)

    model.forward = forward
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    outputs = pipelined_loop(pipeline, Batches(batches))
    failed = outputs.pop(3)
    return {
        "failed": failed == "ValueError",
        "outputs": same(expected, outputs),
        "state": same(expected_state, dmp_state(model, optimizer)),
    }


def _events(rank: int, world: int, case: dict[str, Any], tmp: str) -> dict[str, bool]:
    """Batch 2 trained with the model in eval mode (its maps only read), and a load of the
    dense layer alone (``strict=False``) before batches 4 and 5: the steps taken ahead are
    undone, and the run equals the plain loop with the same events."""
    from recopt.sharding import TrainPipelineSparseDist

    def load_dense(model: Any) -> None:
        dense = {k: v.clone() for k, v in model.state_dict().items() if "embedding" not in k}
        assert dense  # (the linear layer's weight and bias)
        model.load_state_dict(dense, strict=False)

    events = {2: lambda m: m.eval(), 3: lambda m: m.train(), 4: load_dense, 5: load_dense}
    batches = _batches(rank, case)
    results = []
    for pipelined in (False, True):
        model, optimizer = _build(world, case)
        pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
        data, outputs = Batches(batches), []
        for i, batch in enumerate(batches):
            if i in events:
                events[i](model)
            if pipelined:
                outputs += pipelined_loop_steps(pipeline, data, 1)
            else:
                outputs += plain_loop(model, optimizer, [batch])
        results.append((outputs, dmp_state(model, optimizer), _stats(model)))
    (expected, expected_state, expected_stats), (outputs, state, stats) = results
    return {
        "outputs": same(expected, outputs),
        "state": same(expected_state, state),
        "stats": expected_stats == stats,
    }


RUNNERS = {
    "compare": _compare,
    "resume": _resume,
    "guarded": _guarded,
    "fails_before": _fails_before,
    "events": _events,
}


def _cases(world: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = [
        {"plan": "mixed", "eval": True},
        {"plan": "row_wise", "optimizer": "adam"},
        {"plan": "mixed", "bad_id": (world - 1, 3)},
        {"plan": "mixed", "runner": "resume"},
        {"plan": "mixed", "runner": "guarded"},
        {"plan": "mixed", "runner": "fails_before"},
        {"plan": "mixed", "runner": "events"},
    ]
    if world == 2:
        cases += [
            {"plan": "mixed", "unpooled": True, "eval": True},
            {"plan": "row_wise", "runner": "resume", "optimizer": "adagrad"},
        ]
    return cases


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_sharded_id_maps_equal_the_plain_loop(world: int, tmp_path: Path) -> None:
    failures = failed_cases(RUNNERS, world, _cases(world), str(tmp_path))
    assert not failures, failures


def test_the_cases_cover_every_owner_local_sharding_type() -> None:
    kinds = {kind for plan in PLANS.values() for kind in plan[: NUM_TABLES - 1]}
    assert kinds == {"table_wise", "row_wise", "table_row_wise"}
    maps = _id_maps()
    assert {m.policy for m in maps} == {"lru", "lfu"}
    assert any(m.admit_after and m.ttl_steps for m in maps)  # admission and expiry too
