"""The sharded collection with placements: UVM refused off CUDA on every rank before any
collective; on a GPU, UVM-cached and UVM shards train equal to shards in HBM and checkpoint."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.placement import Location, Placement
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import (
    PlanError,
    ShardedEmbeddingBagCollection,
    construct_module_sharding_plan,
    full_tensor,
    row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

CACHED = Placement(location=Location.UVM_CACHING, cache_load_factor=0.25)
UVM = Placement(location=Location.UVM)


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=48, embedding_dim=8, feature_names=["fb"]),
    ]


def _shardings(placed: bool, world: int) -> dict[str, object]:
    a = CACHED if placed else Placement()
    b = UVM if placed else Placement()
    return construct_module_sharding_plan(
        _tables(), {"a": row_wise(placement=a), "b": table_wise(world - 1, placement=b)}, world
    )


def _refused_on_cpu(rank: int, world: int) -> str:
    try:
        ShardedEmbeddingBagCollection(_tables(), _shardings(True, world), device="cpu")  # type: ignore[arg-type]
    except PlanError as e:
        return str(e)
    return "no error"


def test_uvm_shards_are_refused_on_cpu_before_any_collective() -> None:
    messages = run_on_ranks(_refused_on_cpu, 2, timeout_s=60)
    assert messages[0] == messages[1]
    assert "table 'a' (module ''): placement 'uvm_caching(0.25)' needs a CUDA device" in messages[0]


def _batch(seed: int, device: torch.device) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 6,), generator=g)
    ids = torch.cat(
        [
            torch.randint(0, 64, (int(lengths[:6].sum()),), generator=g),
            torch.randint(0, 48, (int(lengths[6:].sum()),), generator=g),
        ]
    )
    return KeyedJaggedTensor(["fa", "fb"], ids.to(device), lengths=lengths.to(device))


def _train(placed: bool, rank: int, world: int) -> dict[str, torch.Tensor]:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    module = ShardedEmbeddingBagCollection(
        _tables(),
        _shardings(placed, world),  # type: ignore[arg-type]
        # fbgemm in HBM too: the test compares placements, not backends.
        optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1, backend=Backend.FBGEMM),
        device=device,
    )
    for step in range(3):
        module(_batch(step * world + rank, device)).values().square().sum().backward()
    from recopt.kernels import flush_kernel_caches

    flush_kernel_caches(module)
    return {k: full_tensor(v).cpu() for k, v in module.state_dict().items()}


def _compare(rank: int, world: int) -> bool:
    reference, placed = _train(False, rank, world), _train(True, rank, world)
    for key, value in reference.items():
        torch.testing.assert_close(placed[key], value, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.cuda
def test_cuda_placed_shards_train_equal_to_shards_in_hbm() -> None:
    assert run_on_ranks(_compare, 2, timeout_s=270, backend="cuda:gloo") == [True, True]
