"""Weighted mean bags on fbgemm's CPU kernel train as on recopt's and as autograd says.

fbgemm's CPU forward of a mean bag with per-id weights divides by the bag's length, but its
backward did not: every fused update of such a bag was ``length`` times too large (AUTO picks
fbgemm for them where it measures faster). recopt divides the gradient fbgemm receives
(`fbgemm_backend._MeanGradient`); these tests compare the two backends and a plain autograd
reference, bags of several lengths, empty and repeated ids included.
"""

from __future__ import annotations

import pytest
import torch

from recopt.kernels import FusedOptimizerConfig
from recopt.kernels.fbgemm_backend import fbgemm_installed
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.skipif(not fbgemm_installed(), reason="fbgemm is not installed")

TABLES = [
    EmbeddingBagConfig(
        name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0"], pooling="mean"
    ),
    EmbeddingBagConfig(
        name="t1", num_embeddings=7, embedding_dim=8, feature_names=["f1"], pooling="mean"
    ),
]


def _batch(step: int) -> KeyedJaggedTensor:
    """3 bags per feature: lengths 2, 0, 3 (f0, an id repeated) and 1, 4, 2 (f1)."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.cat([torch.tensor([1, 4, 4, 9, 2]), torch.randint(0, 7, (7,), generator=gen)])
    weights = torch.rand(12, generator=gen) + 0.25
    lengths = torch.tensor([2, 0, 3, 1, 4, 2])
    return KeyedJaggedTensor(["f0", "f1"], ids, weights=weights, lengths=lengths)


def _trained(
    backend: str, optimizer: str, device: str = "cpu", steps: int = 3
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    config = FusedOptimizerConfig(name=optimizer, lr=0.5, backend=backend)
    ebc = FusedEmbeddingBagCollection(TABLES, config, is_weighted=True, device=device)
    for step in range(steps):
        pooled = ebc(_batch(step).to(device)).values()
        (pooled * torch.arange(1.0, pooled.shape[1] + 1, device=device)).sum().backward()
    state = ebc.fused_optimizer.state_dict()["state"]
    return [t.cpu() for t in [*(p.detach() for p in ebc.parameters()), *_tensors(state)]]


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    return []


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "row_wise_adagrad"])
def test_fbgemm_trains_weighted_mean_bags_as_recopt(optimizer: str) -> None:
    expected, got = _trained("recopt", optimizer), _trained("fbgemm", optimizer)
    assert len(expected) == len(got) >= len(TABLES)  # weights, then any optimizer state
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_fbgemm_weighted_mean_step_equals_autograd() -> None:
    """One SGD step (lr 1) moves each row by minus its autograd gradient, per-id weights'
    gradients included."""
    torch.manual_seed(0)
    config = FusedOptimizerConfig(name="sgd", lr=1.0, backend="fbgemm")
    ebc = FusedEmbeddingBagCollection(TABLES, config, is_weighted=True)
    before = [p.detach().clone() for p in ebc.parameters()]
    kjt = _batch(0)
    weights = kjt.weights().clone().requires_grad_()
    kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())
    pooled = ebc(kjt).values()
    scale = torch.arange(1.0, pooled.shape[1] + 1)
    (pooled * scale).sum().backward()

    rows = [w.clone().requires_grad_() for w in before]
    reference_weights = kjt.weights().detach().clone().requires_grad_()
    bags = []
    lengths = kjt.lengths().tolist()
    start = 0
    for f, table in enumerate(rows):
        for length in lengths[3 * f : 3 * f + 3]:
            ids = kjt.values()[start : start + length]
            w = reference_weights[start : start + length, None]
            bag = (w * table[ids]).sum(0) / max(length, 1)
            bags.append(bag)
            start += length
    pooled_ref = torch.cat([torch.stack(bags[:3]), torch.stack(bags[3:])], 1)
    torch.testing.assert_close(pooled.detach(), pooled_ref.detach())
    (pooled_ref * scale).sum().backward()
    for after, start_rows, table in zip(ebc.parameters(), before, rows, strict=True):
        assert table.grad is not None
        torch.testing.assert_close(after.detach(), start_rows - table.grad)
    assert weights.grad is not None and reference_weights.grad is not None
    torch.testing.assert_close(weights.grad, reference_weights.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["sgd", "row_wise_adagrad"])
def test_fbgemm_on_cuda_trains_weighted_mean_bags_as_recopt_on_cpu(optimizer: str) -> None:
    """fbgemm's CUDA backward divides a mean bag's gradient itself (recopt leaves it alone
    there): the same training as recopt's CPU kernel. Not yet run on a GPU."""
    expected, got = _trained("recopt", optimizer), _trained("fbgemm", optimizer, "cuda")
    assert len(expected) == len(got) >= len(TABLES)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
