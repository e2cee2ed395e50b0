"""Fused embedding tables under fault tolerance: dropped steps roll back bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from ft_solo import SoloTransaction
from torch import nn

from recopt.ft import OptimizerWrapper
from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.replica_sync import (
    EmbeddingReplicaSync,
    average_row_gradients,
)
from recopt.kernels import registry
from recopt.kernels.config import Backend
from recopt.modules import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    FusedOptimizerConfig,
)
from recopt.sparse import KeyedJaggedTensor

OPTIMIZERS = list(registry.OPTIMIZERS)  # every fused optimizer


def _tables(shared: bool = True) -> list[EmbeddingBagConfig]:
    """Two tables; with ``shared`` t1 is looked up by two features (fbgemm's CPU kernels
    refuse that for some optimizers, so their cases use one feature per table)."""
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=30,
            embedding_dim=4,
            feature_names=["f1", "f2"] if shared else ["f1"],
        ),
    ]


def _batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    ids: dict[str, list[list[int]]] = {}
    for name, rows in (("f0", 50), ("f1", 30), ("f2", 30)):
        ids[name] = [
            torch.randint(0, rows, (int(n),), generator=g).tolist()
            for n in torch.randint(0, 4, (6,), generator=g)
        ]
    return KeyedJaggedTensor.from_id_lists(ids)


def _full_state(module: FusedEmbeddingBagCollection) -> dict[str, Any]:
    return copy.deepcopy(
        {"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}
    )


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _train(module: nn.Module, seed: int) -> None:
    module(_batch(seed)).values().pow(2).sum().backward()


CASES = [(name, Backend.RECOPT) for name in OPTIMIZERS] + [
    (name, Backend.FBGEMM) for name in ("sgd", "adagrad", "row_wise_adagrad")
]


@pytest.mark.parametrize("name, backend", CASES)
def test_aborted_step_restores_every_table_and_state(name: str, backend: Backend) -> None:
    torch.manual_seed(0)
    # fbgemm's CPU kernels ignore weight decay, so recopt refuses it there (issue 23).
    decay = 0.0 if backend == Backend.FBGEMM else 0.01
    config = FusedOptimizerConfig(name=name, lr=0.05, weight_decay=decay, backend=backend)
    tables = _tables(shared=backend != Backend.FBGEMM)
    module = FusedEmbeddingBagCollection(tables, optimizer=config)
    guard = FusedEmbeddingGuard(module)
    for seed in range(3):  # committed steps build up optimizer state (and its step count)
        guard.on_start()
        _train(module, seed)
        guard.on_commit()
    before = _full_state(module)
    guard.on_start()
    _train(module, 10)
    _train(module, 11)  # two forwards in one step, overlapping rows
    assert guard.snapshot_bytes() > 0
    changed = _full_state(module)
    with pytest.raises(AssertionError):
        _assert_equal(before, changed)  # the fused update did happen in backward
    guard.on_abort()
    _assert_equal(before, _full_state(module))
    # The next committed step proceeds from the restored state as if nothing happened.
    twin = FusedEmbeddingBagCollection(tables, optimizer=config)
    twin.load_state_dict(before["model"])
    twin.fused_optimizer.load_state_dict(before["optim"])
    guard.on_start()
    _train(module, 12)
    guard.on_commit()
    _train(twin, 12)
    _assert_equal(_full_state(twin), _full_state(module))


def test_aborted_step_restores_an_embedding_collection() -> None:
    """The guard finds an embedding collection's tables (params ``embeddings.<t>.weight``)."""
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=t.feature_names,
        )
        for t in _tables()
    ]
    module = FusedEmbeddingCollection(tables, optimizer=FusedOptimizerConfig(name="adam", lr=0.05))

    def train(seed: int) -> None:
        rows = module(_batch(seed)).values()
        torch.stack([jt.values().pow(2).sum() for jt in rows]).sum().backward()

    guard = FusedEmbeddingGuard(module)
    guard.on_start()
    train(0)
    guard.on_commit()
    before = _full_state(module)  # type: ignore[arg-type]
    guard.on_start()
    train(1)
    with pytest.raises(AssertionError):
        _assert_equal(before, _full_state(module))  # type: ignore[arg-type]
    guard.on_abort()
    _assert_equal(before, _full_state(module))  # type: ignore[arg-type]


def test_no_snapshot_without_grad() -> None:
    module = FusedEmbeddingBagCollection(_tables(), optimizer=FusedOptimizerConfig(name="sgd"))
    guard = FusedEmbeddingGuard(module)
    with torch.no_grad():
        module(_batch(0))
    assert guard.snapshot_bytes() == 0


def test_row_gradient_averaging_is_consistent_across_replicas() -> None:
    ids = [torch.tensor([1, 4, 7]), torch.tensor([4, 5]), torch.tensor([], dtype=torch.int64)]
    grads = [torch.randn(len(i), 3) for i in ids]
    mine = average_row_gradients(ids[0], ids, grads)
    torch.testing.assert_close(mine[0], grads[0][0] / 3)
    torch.testing.assert_close(mine[1], (grads[0][1] + grads[1][0]) / 3)
    # Every replica computes the same bits for a row both touched.
    theirs = average_row_gradients(ids[1], ids, grads)
    assert torch.equal(theirs[0], mine[1])
    assert average_row_gradients(ids[2], ids, grads).shape == (0, 3)


def test_step_below_min_replica_size_rolls_back_fused_tables_with_dense_model() -> None:
    """Below min_replica_size nothing commits, dense or fused (the engine-independent half
    of a step; the torchft contract test runs the same rollback across replica groups)."""
    torch.manual_seed(0)
    sparse = FusedEmbeddingBagCollection(
        _tables(), optimizer=FusedOptimizerConfig(name="adam", lr=0.1, backend=Backend.RECOPT)
    )
    dense = nn.Linear(16, 1)
    inner = torch.optim.AdamW(dense.parameters(), lr=0.1, weight_decay=0.1)

    def state_dict() -> dict[str, Any]:
        return _full_state(sparse) | {"dense": dense.state_dict(), "dopt": inner.state_dict()}

    manager = SoloTransaction(min_replica_size=2)
    FusedEmbeddingGuard(sparse, manager)
    optim = OptimizerWrapper(manager, inner)
    before = copy.deepcopy(state_dict())
    for seed in range(3):
        optim.zero_grad()
        rows = copy.deepcopy(sparse.state_dict())
        dense(sparse(_batch(seed)).values()).pow(2).sum().backward()
        moved = [not torch.equal(rows[k], v) for k, v in sparse.state_dict().items()]
        assert any(moved)  # backward updated the fused rows ...
        optim.step()  # ... and the dropped step put them back
    assert manager.current_step() == 0 and manager.num_participants() == 1
    _assert_equal(before, state_dict())


class _TwoReplicaStub:
    """A Manager stand-in whose peer ran the hook for ``peer_table`` (or the same table)."""

    def __init__(self, peer_table: int | None = None) -> None:
        self.peer_table = peer_table
        self.errors: list[Exception] = []
        self.participants: list[Any] = []

    def register_participant(self, participant: Any) -> None:
        self.participants.append(participant)

    def participant_rank(self) -> int:
        return 0

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        peer = tensor.clone()
        if self.peer_table is not None and tensor.dtype == torch.int64:
            peer[1] = self.peer_table
        elif tensor.dtype != torch.int64:
            peer = peer * 3  # the peer's gradients for the same rows
        return [tensor, peer]


def test_row_exchange_averages_and_refuses_mismatched_tables() -> None:
    config = FusedOptimizerConfig(name="adam", backend=Backend.RECOPT)
    tables = _tables()
    ids, grads = torch.tensor([2, 5]), torch.ones(2, 8)

    stub = _TwoReplicaStub()
    module = FusedEmbeddingBagCollection(tables, optimizer=config)
    EmbeddingReplicaSync(module, stub, FusedEmbeddingGuard(module))  # type: ignore[arg-type]
    hook = module.kernels()[0].grad_hook
    averaged = hook(0, ids, grads)
    assert torch.equal(averaged, torch.full((2, 8), 2.0)) and not stub.errors  # (1 + 3) / 2

    stub = _TwoReplicaStub(peer_table=1)
    module = FusedEmbeddingBagCollection(tables, optimizer=config)
    EmbeddingReplicaSync(module, stub, FusedEmbeddingGuard(module))  # type: ignore[arg-type]
    local = module.kernels()[0].grad_hook(0, ids, grads)
    assert local is grads  # no averaging with another table's rows
    assert len(stub.errors) == 1 and "grad_hook for every table" in str(stub.errors[0])


def test_replica_sync_refuses_kernels_without_hook() -> None:
    module = FusedEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=["f"])],
        optimizer=FusedOptimizerConfig(name="sgd", backend=Backend.FBGEMM),
    )
    with pytest.raises(ValueError, match="backend='recopt'"):
        EmbeddingReplicaSync(module, _TwoReplicaStub(), FusedEmbeddingGuard(module))  # type: ignore[arg-type]
