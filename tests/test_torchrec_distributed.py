"""recopt.torchrec.distributed: TorchRec's DistributedModelParallel signature (sharders with
fused_params, env, no plan) over recopt's DMP, compared with recopt's fused module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import FusedEmbeddingBagCollection
from recopt.sharding import full_tensor
from recopt.testing import run_on_ranks
from recopt.torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recopt.torchrec.distributed import DistributedModelParallel, ShardingEnv
from recopt.torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=16, embedding_dim=4, feature_names=["fa"]),
    EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=8, feature_names=["fb"]),
]
FUSED_PARAMS = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.3, "eps": 1e-6}


def _dmp_with_sharder(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    reference = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="adagrad", lr=0.3, eps=1e-6)
    )
    reference.load_state_dict(ebc.state_dict())
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)  # type: ignore[arg-type]
    sharders = [EmbeddingBagCollectionSharder(fused_params=FUSED_PARAMS)]
    dmp = DistributedModelParallel(ebc, env=env, sharders=sharders)
    kjt = KeyedJaggedTensor.from_id_lists({"fa": [[1, 2], [15, 1]], "fb": [[0], [3, 8]]})
    for module in (dmp, reference):
        for _ in range(2):
            module(kjt).values().square().sum().backward()
    got = {k: full_tensor(v) for k, v in dmp.state_dict().items()}
    want = reference.state_dict()
    groups = sorted((g["optimizer"], g["lr"], g["eps"]) for g in dmp.fused_optimizer.param_groups)
    close = all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-5) for k in want)
    return {"close": close and set(got) == set(want), "groups": groups}


def test_sharder_fused_params_train_as_the_fused_module() -> None:
    for result in run_on_ranks(_dmp_with_sharder, 2, timeout_s=180):
        assert result["groups"] == [("adagrad", 0.3, 1e-6)]
        assert result["close"]  # fp32 Adagrad, two steps: equal up to rounding


def _refusals(rank: int, world: int) -> bool:
    with pytest.raises(ValueError, match="init_data_parallel"):
        DistributedModelParallel(EmbeddingBagCollection(TABLES), init_data_parallel=False)
    with pytest.raises(ValueError, match="data_parallel_wrapper"):
        DistributedModelParallel(EmbeddingBagCollection(TABLES), data_parallel_wrapper=object())
    return True


def test_dmp_refuses_what_recopt_does_not_offer() -> None:
    assert run_on_ranks(_refusals, 1, timeout_s=120) == [True]
