"""Fault tolerance and NaN/inf gradients: a step where any replica saw one is dropped everywhere.

Unit tier: the row-gradient hooks and the embedding guard report `NonFiniteGradientError` to the
manager (a stand-in). Multi-process tier: two replica groups (tests/ft_fused_worker.py), one of
which has a NaN loss at one iteration: that step commits on neither replica, nobody is left
waiting, and training ends bit-identical to a run that never saw the NaN.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_cluster import FUSED_WORKER, Cluster, assert_same_state

from recopt.ft import Manager, ManagerConfig, NonFiniteGradientError
from recopt.ft.embedding import EmbeddingReplicaSync, FusedEmbeddingGuard, make_grad_hook
from recopt.ft.lighthouse import Lighthouse, LighthouseConfig
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


@pytest.mark.parametrize("union", [False, True])
def test_plain_grad_hook_reports_non_finite_rows(union: bool) -> None:
    replicas = _Replicas(float("nan"))
    hook = make_grad_hook(replicas, union=union)  # type: ignore[arg-type]
    ids = torch.tensor([1, 4])
    out = hook(0, ids, torch.ones(2, 8))
    grads = out[1] if union else out
    assert torch.equal(grads, torch.zeros(2, 8))
    assert [type(e) for e in replicas.errors] == [NonFiniteGradientError]


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


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(LighthouseConfig(min_replicas=1), host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def test_manager_drops_a_step_whose_averaged_dense_gradient_is_not_finite(
    lighthouse: Lighthouse,
) -> None:
    timeout = datetime.timedelta(seconds=10)
    config = ManagerConfig(
        replica_id="solo",
        lighthouse=("127.0.0.1", lighthouse.port),
        timeout=timeout,
        quorum_timeout=timeout,
        hostname="127.0.0.1",
    )
    manager = Manager(config, state_dict=dict, load_state_dict=lambda s: None)
    try:
        param = torch.nn.Parameter(torch.ones(3))
        for grad, commits in ((torch.tensor([1.0, float("inf"), 0.0]), False), (None, True)):
            manager.start_quorum()
            param.grad = grad if grad is not None else torch.ones(3)
            manager.allreduce_gradients([param])
            if not commits:
                assert isinstance(manager.errored(), NonFiniteGradientError)
            assert manager.should_commit() is commits
    finally:
        manager.shutdown()


def _run(tmp_path: Path, *extra: str) -> Cluster:
    tmp_path.mkdir()
    cluster = Cluster(tmp_path)
    port = cluster.start_lighthouse(min_replicas=2, join_s=1.0, hb_s=2.0)
    procs = [
        cluster._spawn(
            [
                str(FUSED_WORKER),
                f"--replica-id={name}",
                f"--rank-seed={seed}",
                f"--lighthouse-port={port}",
                f"--out={tmp_path}",
                "--steps=4",
                *(extra if name == "a" else ()),
            ],
            f"{name}.log",
        )
        for name, seed in (("a", 1), ("b", 2))
    ]
    try:
        for proc in procs:
            assert proc.wait(timeout=90) == 0, cluster.logs()
    finally:
        cluster.close()
    return cluster


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_nan_on_one_replica_drops_the_step_on_both(tmp_path: Path) -> None:
    clean = _run(tmp_path / "clean")
    bad = _run(tmp_path / "bad", "--nan-at=2")
    for name in ("a", "b"):
        entries = {e["iteration"]: e for e in bad.entries(name)}
        assert entries[2]["committed"] is False, (name, entries)
        assert entries[1]["committed"] and entries[3]["committed"]
        assert bad.steps_saved(name) == clean.steps_saved(name) == {1, 2, 3, 4}
    # The dropped step left no trace: every committed state equals the clean run's.
    for step in (1, 2, 3, 4):
        assert_same_state(bad.state("a", step), bad.state("b", step))
        assert_same_state(bad.state("a", step), clean.state("a", step))
