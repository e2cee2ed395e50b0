"""Both embedding twins resolve optimizers, build param groups and sync the learning rate with
one helper (recopt/modules/fused_groups.py): their param groups must agree."""

from __future__ import annotations

import pytest
import torch

import recopt.ft
from recopt.ft import FaultTolerantOptimizer, replica_sync_optimizer
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules.config import EmbeddingBagConfig
from recopt.modules.fused import FusedEmbeddingBagCollection
from recopt.modules.fused_groups import optimizer_from_param_group
from recopt.optim.fused import FusedOptimizer, is_fused
from recopt.sharding.plan_helpers import balanced_table_wise_plan
from recopt.sharding.sharded_embedding import ShardedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4, feature_names=["f1"]),
]


def _groups(module: torch.nn.Module) -> list[dict]:
    opt = module.fused_optimizer  # type: ignore[attr-defined]
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _sharded_groups(rank: int, world_size: int, backend: Backend) -> list[dict]:
    plan = balanced_table_wise_plan({"": TABLES}, world_size)
    module = ShardedEmbeddingBagCollection(
        TABLES, plan[""], optimizer=FusedOptimizerConfig(name="sgd", lr=0.1, backend=backend)
    )
    return _groups(module)


@pytest.mark.parametrize("backend", [Backend.FBGEMM, Backend.RECOPT])
def test_param_groups_agree_between_twins(backend: Backend) -> None:
    fused = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="sgd", lr=0.1, backend=backend)
    )
    groups = _groups(fused)
    assert groups[0]["backend"] == backend.value
    assert groups[0]["backend"] == fused.kernels()[0].backend.value
    assert run_on_ranks(_sharded_groups, 1, backend) == [groups]


def test_unknown_table_override_raises_in_both_twins() -> None:
    overrides = {"nope": FusedOptimizerConfig()}
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\]"):
        FusedEmbeddingBagCollection(TABLES, table_optimizers=overrides)


def test_param_group_round_trips_to_the_optimizer() -> None:
    opt = FusedOptimizerConfig(name="adafactor", lr=0.02, eps=(None, 1e-2), d=2.0)
    fused = FusedEmbeddingBagCollection(TABLES, optimizer=opt)
    group = fused.fused_optimizer.param_groups[0]
    assert group["optimizer"] == opt.name and "d" not in group
    assert optimizer_from_param_group(group) == opt


def test_learning_rate_change_reaches_the_kernel_once() -> None:
    fused = FusedEmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig(name="sgd"))
    kernel = fused.kernels()[0]
    fused.fused_optimizer.param_groups[0]["lr"] = 0.25
    assert kernel.get_learning_rate() == pytest.approx(0.01)  # applied at the next forward
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0])
    )
    fused(kjt)
    assert kernel.get_learning_rate() == pytest.approx(0.25)


def test_replica_sync_optimizer_makes_auto_hookable_and_keeps_forced_backends() -> None:
    auto = FusedOptimizerConfig(name="sgd")
    assert replica_sync_optimizer(auto, True).backend == Backend.RECOPT
    assert replica_sync_optimizer(auto, False) == auto
    forced = FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM)
    assert replica_sync_optimizer(forced, True) == forced


def test_names_fault_tolerant_optimizer_alias_and_concrete_fused_optimizer() -> None:
    assert recopt.ft.OptimizerWrapper is FaultTolerantOptimizer
    fused = FusedOptimizer({}, {}, [])  # concrete: step runs the closure, nothing else
    assert fused.step(lambda: 3.0) == 3.0 and fused.step() is None
    collection = FusedEmbeddingBagCollection(TABLES)
    assert is_fused(collection) and not is_fused(torch.nn.Linear(2, 2))
    assert isinstance(collection.fused_optimizer, FusedOptimizer)
