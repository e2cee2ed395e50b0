"""Pipelined id maps in one process through what undoes or orphans the steps taken ahead.

Each case runs the same events in the plain loop and in `TrainPipelineSparseDist` and
compares the end state (weights, optimizer state, every map buffer, stats): a load that
leaves the maps out, a step trained with the model in eval mode, a copy of the model between
steps, fault tolerance's guard attached while a step is pending, `reset` or a new pipeline
taking over the model, and a model of two id-mapped collections of which one alone is undone.
Before these were handled, each ended a step apart from the plain loop or stopped training
("taken out of order").
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from pipeline_helpers import (
    DIM,
    RAW_ROWS,
    Batches,
    TinyModel,
    fused_state,
    id_map_model,
    pipelined_loop,
    plain_loop,
    raw_batch,
    same,
)
from torch import nn

from recopt.data.batch import Batch
from recopt.kernels import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.sharding import TrainPipelineSparseDist

BATCHES = [raw_batch(i) for i in range(8)]


def _state(model: TinyModel, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    return fused_state(model, optimizer), model.embedding_bags.stats()


def _steps(model: TinyModel, optimizer: Any, events: dict[int, Any], pipelined: bool) -> Any:
    """Every batch of `BATCHES`, ``events[i](model)`` before batch i's step; the state."""
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu") if pipelined else None
    data = Batches(BATCHES)
    for i, batch in enumerate(BATCHES):
        if i in events:
            events[i](model)
        if pipeline is not None:
            pipeline.progress(data)
        else:
            plain_loop(model, optimizer, [batch])
    return _state(model, optimizer)


def _both(policy: str, events: dict[int, Any]) -> tuple[Any, Any]:
    expected = _steps(*id_map_model(policy), events, pipelined=False)
    return expected, _steps(*id_map_model(policy), events, pipelined=True)


@pytest.mark.parametrize("policy", ["lru", "lfu", "admit2-ttl"])
def test_a_load_that_leaves_the_maps_out(policy: str) -> None:
    """A load of the dense layer alone (``strict=False``) between steps: the maps stay as the
    plain loop has them (the load used to drop the step taken ahead without undoing it, and
    the batch was remapped again: the maps a step ahead)."""

    def load_dense(model: TinyModel) -> None:
        dense = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("top.")}
        model.load_state_dict(dense, strict=False)

    expected, got = _both(policy, {3: load_dense, 5: load_dense})
    assert same(expected, got)


def test_a_step_in_eval_mode_only_reads_the_maps() -> None:
    """Batches trained with the model in eval mode: their maps are only read, as in the plain
    loop (the forward used to take the training step the pipeline had started ahead)."""
    events = {2: lambda m: m.eval(), 3: lambda m: m.train(), 5: lambda m: m.eval()}
    states = []
    for pipelined in (False, True):
        model, optimizer = id_map_model("lru")
        states.append(_steps(model, optimizer, events, pipelined))
        steps = model.embedding_bags.id_maps.table_map("t0").buffer("step")
        assert int(steps) == 4  # batches 0, 1, 3 and 4 stepped the maps
    assert same(*states)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_between_steps_is_the_plain_loops(how: str) -> None:
    """A copy of the model between steps (an evaluation snapshot) equals the plain loop's at
    that point (it used to hold the maps with the step taken ahead, its fresh rows not reset),
    and the original trains on as the plain loop."""
    copies: dict[str, list[Any]] = {"plain": [], "pipelined": []}

    def copied(into: list[Any]) -> Any:
        def take(model: TinyModel) -> None:
            if how == "deepcopy":
                into.append(copy.deepcopy(model))
            else:
                buffer = io.BytesIO()
                torch.save(model, buffer)
                buffer.seek(0)
                into.append(torch.load(buffer, weights_only=False))

        return take

    expected = _steps(*id_map_model("lfu"), {4: copied(copies["plain"])}, pipelined=False)
    got = _steps(*id_map_model("lfu"), {4: copied(copies["pipelined"])}, pipelined=True)
    assert same(expected, got)
    plain, pipelined = copies["plain"][0], copies["pipelined"][0]
    assert plain.state_dict().keys() == pipelined.state_dict().keys()
    assert same(list(plain.state_dict().values()), list(pipelined.state_dict().values()))
    for a, b in zip(plain.buffers(), pipelined.buffers(), strict=True):
        assert torch.equal(a, b)  # the live maps too, not only their committed state
    for model in (plain, pipelined):
        model.eval()
    with torch.no_grad():
        assert same(plain(raw_batch(40))[1], pipelined(raw_batch(40))[1])


def test_a_guard_attached_mid_run_rolls_back_a_dropped_step() -> None:
    """Fault tolerance's guard attached after 3 pipelined steps (batch 3's map step already
    taken ahead), then batch 3's step dropped and trained again: the end state equals the
    plain loop without the drop (the guard used to miss the pending step, so the rollback left
    the map a step ahead)."""
    from recopt.ft.embedding import FusedEmbeddingGuard

    model, optimizer = id_map_model("lru")
    expected = plain_loop(model, optimizer, BATCHES)
    expected_state = _state(model, optimizer)

    model, optimizer = id_map_model("lru")
    answers = iter([True] * 3 + [False] + [True] * len(BATCHES))  # batch 3's first try dropped
    guard: list[FusedEmbeddingGuard] = []
    dense = list(model.top.parameters())
    before: list[torch.Tensor] = []

    def step_committed() -> bool:
        committed = next(answers)
        if guard:
            if committed:
                guard[0].on_commit()
            else:
                guard[0].on_abort()
                with torch.no_grad():
                    for p, saved in zip(dense, before, strict=True):
                        p.copy_(saved)
            guard[0].on_start()
            before[:] = [p.detach().clone() for p in dense]
        return committed

    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu", step_committed=step_committed)
    data = Batches(BATCHES)
    outputs = [pipeline.progress(data) for _ in range(3)]
    assert len(model.embedding_bags.id_maps.ahead) == 1  # batch 3's step, taken ahead
    guard.append(FusedEmbeddingGuard(model.embedding_bags))
    guard[0].on_start()
    before[:] = [p.detach().clone() for p in dense]
    outputs += pipelined_loop(pipeline, data)
    dropped = outputs.pop(3)
    assert same(dropped, outputs[3])  # the dropped attempt and its retry
    assert same(expected, outputs)
    assert same(expected_state, _state(model, optimizer))


@pytest.mark.parametrize("how", ["reset", "new pipeline"])
def test_another_pipeline_or_a_reset_takes_over(how: str) -> None:
    """After 3 steps the pipeline is reset (or a new one built on the model, as a loop that
    makes one per epoch does) and trains from another iterator: the batches in flight never
    train, and the rest equals the plain loop without them (every step used to raise
    "taken out of order")."""
    first, second = BATCHES[:5], [raw_batch(i) for i in range(20, 25)]
    model, optimizer = id_map_model("lfu")
    expected = plain_loop(model, optimizer, first[:3] + second)
    expected_state = _state(model, optimizer)

    model, optimizer = id_map_model("lfu")
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(first)
    outputs = [pipeline.progress(data) for _ in range(3)]
    if how == "reset":
        pipeline.reset()
    else:
        pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    outputs += pipelined_loop(pipeline, Batches(second))
    assert same(expected, outputs)
    assert same(expected_state, _state(model, optimizer))
    assert len(model.embedding_bags.id_maps.ahead) == 0


class _TwoTowers(nn.Module):
    """Two fused id-mapped collections (``a``: features f0 and f1, ``b``: f2), their pooled
    outputs through one linear layer; ``fail_between`` raises between the two once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.3)
        self.a = FusedEmbeddingBagCollection(_tower("a", ["f0", "f1"]), optimizer)
        self.b = FusedEmbeddingBagCollection(_tower("b", ["f2"]), optimizer)
        self.top = nn.Linear(3 * DIM, 1)
        self.fail_between = False

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled_a = self.a(batch.sparse).values()
        if self.fail_between:
            self.fail_between = False
            raise ValueError("failed between the towers")
        pooled = torch.cat([pooled_a, self.b(batch.sparse).values()], 1)
        logits = self.top(pooled).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def _tower(prefix: str, features: list[str]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"{prefix}{i}",
            num_embeddings=RAW_ROWS,
            embedding_dim=DIM,
            feature_names=[f],
            id_map=IdMapConfig(policy="lfu", decay=0.9),
        )  # fmt: skip
        for i, f in enumerate(features)
    ]


def _fail_between(model: _TwoTowers) -> None:
    model.fail_between = True


def _load_a(model: _TwoTowers) -> None:
    model.a.load_state_dict({k: v.clone() for k, v in model.a.state_dict().items()})


def _evaluate_a(model: _TwoTowers) -> None:
    model.eval()
    with torch.no_grad():
        model.a(raw_batch(50).sparse)
    model.train()


@pytest.mark.parametrize("event", [_fail_between, _load_a, _evaluate_a], ids=lambda f: f.__name__)
def test_two_collections_of_which_one_is_undone(event: Any) -> None:
    """One collection's step taken ahead is undone and the other's is not (a step failing
    between them, a load or an evaluation of one): the pipeline starts both again and trains
    on as the plain loop (it used to remap the other's batch twice, then stop)."""

    def run(pipelined: bool) -> tuple[list[Any], list[torch.Tensor]]:
        model = _TwoTowers()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        pipeline = TrainPipelineSparseDist(model, optimizer, "cpu") if pipelined else None
        data, outputs = Batches(BATCHES), []
        for i, batch in enumerate(BATCHES):
            if i == 3:
                event(model)
            if pipeline is not None:
                outputs += pipelined_loop_steps(pipeline, data)
            else:
                outputs += plain_loop(model, optimizer, [batch])
        return outputs, [v.clone() for v in model.state_dict().values()]

    expected, got = run(False), run(True)
    assert same(expected, got)
    failed = [i for i, output in enumerate(expected[0]) if isinstance(output, str)]
    assert failed == ([3] if event is _fail_between else [])


def pipelined_loop_steps(pipeline: TrainPipelineSparseDist, data: Batches) -> list[Any]:
    """One `progress`, its output (or its ValueError's type name, as `plain_loop` records)."""
    try:
        return [pipeline.progress(data)]
    except ValueError as e:
        return [type(e).__name__]


def test_a_failed_checkpoint_load_between_steps_changes_nothing(tmp_path: Any) -> None:
    """A checkpoint load that fails after the model's state was copied in (an extra refuses
    its state) while batch 3's step is pending: the model is as before the load, and training
    on equals the plain loop without the load (the maps used to keep the checkpoint's
    buffers: the load's backup held copies of them, made for the pending step)."""
    from recopt.checkpoint import CheckpointError, load, save

    class Refuses:  # the checkpoint's state, once (the load's undo then puts its own back)
        refused = False

        def state_dict(self) -> dict[str, int]:
            return {"x": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            if not self.refused:
                self.refused = True
                raise ValueError("refused")

    other, other_optimizer = id_map_model("lru")
    plain_loop(other, other_optimizer, [raw_batch(i) for i in range(30, 36)])
    optimizers = {"fused": other.embedding_bags.fused_optimizer, "dense": other_optimizer}
    save(tmp_path / "other", other, optimizers, extra={"e": Refuses()})

    model, optimizer = id_map_model("lru")
    expected = plain_loop(model, optimizer, BATCHES)
    expected_state = _state(model, optimizer)
    model, optimizer = id_map_model("lru")
    pipeline = TrainPipelineSparseDist(model, optimizer, "cpu")
    data = Batches(BATCHES)
    outputs = [pipeline.progress(data) for _ in range(3)]
    before = [v.clone() for v in model.state_dict().values()]
    optimizers = {"fused": model.embedding_bags.fused_optimizer, "dense": optimizer}
    with pytest.raises(CheckpointError, match="nothing was changed"):
        load(tmp_path / "other", model, optimizers, extra={"e": Refuses()})
    assert same(before, list(model.state_dict().values()))
    outputs += pipelined_loop(pipeline, data)
    assert same(expected, outputs)
    assert same(expected_state, _state(model, optimizer))
