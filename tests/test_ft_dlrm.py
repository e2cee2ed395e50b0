"""make_fault_tolerant on the DLRM model: a late replica heals to the exact DLRM state.

Two replica groups run as threads of this process (each with its own Manager, checkpoint
server and gloo group) around an in-process lighthouse: cheap, yet every byte of the healing
path (serialise, HTTP, strict in-place KeyedOptimizer load) is the real one.
"""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from recopt.ft.launch import FaultTolerantTraining, make_fault_tolerant
from recopt.ft.lighthouse import Lighthouse, LighthouseConfig
from recopt.ft.manager import ManagerConfig
from recopt.kernels.config import Backend
from recopt.models.dlrm import DLRM, DLRMConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, FusedOptimizerConfig
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.timeout(120)


def _dlrm(seed: int) -> tuple[nn.Module, CombinedOptimizer]:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=20, embedding_dim=8, feature_names=[f"f{i}"]
        )
        for i in range(2)
    ]
    sparse = FusedEmbeddingBagCollection(
        tables,
        optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, backend=Backend.FBGEMM),
    )
    model = DLRM(sparse, DLRMConfig(dense_in_features=4, bottom_mlp=(8, 8), top_mlp=(8,)))
    dense = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = CombinedOptimizer(
        [
            ("sparse", sparse.fused_optimizer),
            ("dense", KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adam(p, lr=0.01))),
        ]
    )
    return model, optimizer


def _step(ft: FaultTolerantTraining, model: nn.Module, seed: int, after_quorum: Any = None) -> None:
    ft.optimizer.zero_grad()
    if after_quorum is not None:
        after_quorum()
    g = torch.Generator().manual_seed(seed + 1000 * ft.manager.current_step())
    ids = {
        f"f{i}": [[int(torch.randint(0, 20, (1,), generator=g))] for _ in range(4)]
        for i in range(2)
    }
    logits = model(torch.randn(4, 4, generator=g), KeyedJaggedTensor.from_id_lists(ids))
    nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(4)).backward()
    ft.optimizer.step()


def _state(model: nn.Module, optimizer: CombinedOptimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    # Long: under load, b may take a while to join, and a must wait for it.
    config = LighthouseConfig(join_timeout=datetime.timedelta(seconds=30))
    server = Lighthouse(config, host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def _config(name: str, port: int) -> ManagerConfig:
    timeout = datetime.timedelta(seconds=20)
    return ManagerConfig(
        replica_id=name,
        lighthouse=("127.0.0.1", port),
        timeout=timeout,
        quorum_timeout=timeout,
        hostname="127.0.0.1",
    )


def test_late_replica_heals_to_the_exact_dlrm_state(lighthouse: Lighthouse) -> None:
    model_a, opt_a = _dlrm(seed=1)
    model_b, opt_b = _dlrm(seed=2)
    with pytest.raises(ValueError, match="backend='recopt'"):  # fbgemm tables have no hook
        make_fault_tolerant(model_a, opt_a, _config("a", lighthouse.port))
    ft_a = make_fault_tolerant(model_a, opt_a, _config("a", lighthouse.port), sync_embeddings=False)
    ft_b = None
    try:
        for _ in range(3):
            _step(ft_a, model_a, seed=1)
        assert ft_a.manager.current_step() == 3
        ft_b = make_fault_tolerant(
            model_b, opt_b, _config("b", lighthouse.port), sync_embeddings=False
        )
        a_before = _state(model_a, opt_a)
        healed: dict[str, Any] = {}

        def record() -> None:
            healed.update(_state(model_b, opt_b))  # right after b's quorum, i.e. its heal

        threads = [
            threading.Thread(target=_step, args=(ft_a, model_a, 1)),
            threading.Thread(target=_step, args=(ft_b, model_b, 2, record)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert healed, "b never ran its first step"
        _assert_equal(a_before, healed)  # weights, fused row-wise state, Adam moments
        assert ft_b.manager.current_step() == ft_a.manager.current_step() == 4
        assert ft_b.manager.batches_committed() == ft_a.manager.batches_committed() == 5
        # Healing copied the fused tables; the joint step then kept the dense part equal.
        dense = [k for k in a_before["model"] if "embedding_bags" not in k]
        for key in dense:
            assert torch.equal(model_a.state_dict()[key], model_b.state_dict()[key]), key
    finally:
        ft_a.shutdown()
        if ft_b is not None:
            ft_b.shutdown()
