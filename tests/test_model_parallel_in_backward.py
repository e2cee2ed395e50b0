"""DistributedModelParallel honours optimizers attached by torch's `_apply_optimizer_in_backward`
(TorchRec's way to choose a table's optimizer) instead of its default optimizer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward

from recopt.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.optim import RowWiseAdagrad
from recopt.sharding import DistributedModelParallel, full_tensor
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=16, embedding_dim=4, feature_names=["fa"]),
    EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=8, feature_names=["fb"]),
]


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists({"fa": [[1, 2], [15, 1]], "fb": [[0], [3, 8]]})


def _groups(rank: int, world: int) -> list[tuple[str, float, list[str]]]:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.embedding_bags["a"].parameters(), {"lr": 0.05})
    _apply_optimizer_in_backward(torch.optim.SGD, ebc.embedding_bags["b"].parameters(), {"lr": 0.5})
    dmp = DistributedModelParallel(ebc)
    opt = dmp.fused_optimizer
    name_of = {id(p): n for n, p in opt.params.items()}
    return sorted(
        (g["optimizer"], float(g["lr"]), sorted(name_of[id(p)] for p in g["params"]))
        for g in opt.param_groups
    )


def test_dmp_takes_each_tables_in_backward_optimizer() -> None:
    for groups in run_on_ranks(_groups, 1, timeout_s=120):
        assert groups == [
            ("row_wise_adagrad", 0.05, ["embedding_bags.a.weight"]),
            ("sgd", 0.5, ["embedding_bags.b.weight"]),
        ]


def _step(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    reference = FusedEmbeddingBagCollection(
        TABLES, optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": 0.05}
    )
    reference.load_state_dict(ebc.state_dict())
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(ebc)
    for module in (dmp, reference):
        for _ in range(2):
            module(_batch()).values().square().sum().backward()
    got = {k: full_tensor(v) for k, v in dmp.state_dict().items() if k.endswith("weight")}
    want = {k: v for k, v in reference.state_dict().items() if k.endswith("weight")}
    assert set(got) == set(want)
    return {k: got[k] - want[k] for k in got}


def test_dmp_in_backward_step_equals_the_fused_module() -> None:
    for diffs in run_on_ranks(_step, 2, timeout_s=180):
        for name, diff in diffs.items():
            assert float(diff.abs().max()) < 1e-6, name


def _refused(rank: int, world: int) -> Any:
    ebc = EmbeddingBagCollection(TABLES)
    _apply_optimizer_in_backward(torch.optim.Adam, ebc.embedding_bags["b"].parameters(), {})
    with pytest.raises(ValueError, match=r"table 'b'.*Adam"):
        DistributedModelParallel(ebc)
    return True


def test_dmp_refuses_an_in_backward_optimizer_without_fused_kernel() -> None:
    assert run_on_ranks(_refused, 1, timeout_s=120) == [True]
