"""Per-id weights of any floating dtype behave alike on every backend (converted to the tables')."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.config import Backend
from recopt.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4, feature_names=("f1",)),
]


def _features(dtype: torch.dtype) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"],
        torch.tensor([1, 2, 3, 0, 5, 5]),
        torch.tensor([2, 1, 1, 2]),
        weights=torch.tensor([0.5, 2.0, 1.0, -1.5, 0.25, 3.0], dtype=dtype),
    )


def _fused_step(backend: Backend, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        TABLES,
        optimizer=FusedOptimizerConfig(name="sgd", lr=0.1, backend=backend),
        is_weighted=True,
    )
    out = ebc(_features(dtype)).values()
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()  # the update runs here
    return out.detach(), ebc.state_dict()["embedding_bags.t0.weight"].clone()


@pytest.mark.parametrize("backend", [Backend.RECOPT, Backend.FBGEMM])
def test_float64_weights_equal_float32_weights_on_each_backend(backend: Backend) -> None:
    try:
        out32, table32 = _fused_step(backend, torch.float32)
    except ValueError as err:  # fbgemm not usable here
        pytest.skip(str(err))
    out64, table64 = _fused_step(backend, torch.float64)
    assert out64.dtype == torch.float32
    torch.testing.assert_close(out64, out32)
    torch.testing.assert_close(table64, table32)


def test_plain_collection_converts_weights_to_its_tables_dtype() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    ref = ebc(_features(torch.float32)).values()
    torch.testing.assert_close(ebc(_features(torch.float64)).values(), ref)
    ebc.double()
    torch.testing.assert_close(ebc(_features(torch.float32)).values(), ref.double())
