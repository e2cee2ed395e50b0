"""Fault tolerance and NaN/inf gradients: a step where any replica saw one is dropped everywhere.

Unit tier: the row-gradient hooks, the embedding guard and the averaged dense gradients report
`NonFiniteGradientError` to the manager (stand-ins). Across replica groups on torchft (a NaN on
one group drops the step on every group, rolled back bit for bit) the contract test
tests/test_ft_torchft.py covers it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ft_solo import SoloTransaction

from recopt.ft import NonFiniteGradientError
from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.replica_sync import EmbeddingReplicaSync
from recopt.kernels.config import Backend
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, FusedOptimizerConfig
from recopt.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=20, embedding_dim=8, feature_names=["f0"]),
]


class _Replicas:
    """A Manager stand-in with one peer whose gradients are ``peer_scale`` times ours."""

    def __init__(self, peer_scale: float) -> None:
        self.peer_scale = peer_scale
        self.errors: list[Exception] = []

    def register_participant(self, participant: Any) -> None:
        pass

    def participant_rank(self) -> int:
        return 0

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        peer = tensor.clone() if tensor.dtype == torch.int64 else tensor * self.peer_scale
        return [tensor, peer]


def _module() -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    return FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="adam", lr=0.1, backend=Backend.RECOPT)
    )


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_replica_sync_hook_reports_a_peers_non_finite_rows(scale: float) -> None:
    module = _module()
    replicas = _Replicas(scale)
    EmbeddingReplicaSync(module, replicas, FusedEmbeddingGuard(module))  # type: ignore[arg-type]
    out = module.kernels()[0].grad_hook(0, torch.tensor([1, 4]), torch.ones(2, 8))
    assert torch.equal(out, torch.zeros(2, 8))  # nothing non-finite reaches the state
    assert len(replicas.errors) == 1
    assert isinstance(replicas.errors[0], NonFiniteGradientError)
    assert "quorum rank(s) [1]" in str(replicas.errors[0])


def test_replica_sync_hook_averages_finite_rows_without_error() -> None:
    module = _module()
    replicas = _Replicas(3.0)
    EmbeddingReplicaSync(module, replicas, FusedEmbeddingGuard(module))  # type: ignore[arg-type]
    out = module.kernels()[0].grad_hook(0, torch.tensor([1, 4]), torch.ones(2, 8))
    assert torch.equal(out, torch.full((2, 8), 2.0)) and not replicas.errors


def test_guard_drops_the_step_the_collection_skipped() -> None:
    module = _module()  # no grad_hook: its own gate skips a NaN step locally
    guard = FusedEmbeddingGuard(module)
    features = KeyedJaggedTensor.from_id_lists({"f0": [[1, 2], [3]]})
    guard.on_start()
    module(features).values().sum().backward()
    guard.before_vote()  # finite: nothing to report
    guard.on_commit()
    guard.on_start()
    with pytest.warns(RuntimeWarning, match="NaN or inf"):
        (module(features).values() * float("nan")).sum().backward()
    with pytest.raises(NonFiniteGradientError, match="dropped on every replica"):
        guard.before_vote()
    guard.on_abort()
    guard.on_start()
    module(features).values().sum().backward()
    guard.before_vote()  # the next finite step commits again


def test_manager_drops_a_step_whose_averaged_dense_gradient_is_not_finite() -> None:
    manager = SoloTransaction()
    param = torch.nn.Parameter(torch.ones(3))
    for grad, commits in ((torch.tensor([1.0, float("inf"), 0.0]), False), (None, True)):
        manager.start_quorum()
        param.grad = grad if grad is not None else torch.ones(3)
        manager.allreduce_gradients([param])
        if not commits:
            assert isinstance(manager.errored(), NonFiniteGradientError)
        assert manager.should_commit() is commits
    assert manager.current_step() == 1
