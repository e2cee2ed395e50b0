"""Fused embedding optimizers named by a torch optimizer class (TorchRec's API), the dense
RowWiseAdagrad, fuse_embedding_optimizer and in_backward_optimizer_filter."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    FusedOptimizerConfig,
    fuse_embedding_optimizer,
    fused_config,
)
from recopt.optim import RowWiseAdagrad, in_backward_optimizer_filter
from recopt.sparse import KeyedJaggedTensor


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=6, embedding_dim=4, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=5, embedding_dim=8, feature_names=["b"]),
    ]


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists({"a": [[1, 2], [], [1]], "b": [[0], [3, 3], [4]]})


def test_row_wise_adagrad_equals_adagrad_on_rows_of_equal_gradients() -> None:
    start = torch.arange(12.0).view(3, 4)
    row_wise, plain = start.clone().requires_grad_(), start.clone().requires_grad_()
    ours, reference = RowWiseAdagrad([row_wise], lr=0.1), torch.optim.Adagrad([plain], lr=0.1)
    for step in range(3):
        grad = torch.tensor([1.0, -2.0, 0.5]).unsqueeze(1).expand(3, 4) * (step + 1)
        row_wise.grad, plain.grad = grad.clone(), grad.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(row_wise, plain)
    assert ours.state[row_wise]["sum"].shape == (3,)


def test_row_wise_adagrad_update_rule() -> None:
    """One accumulator per row (the mean of squared grads), decay and lr decay applied."""
    p = torch.ones(2, 2, requires_grad=True)
    opt = RowWiseAdagrad([p], lr=0.5, lr_decay=1.0, weight_decay=0.1, eps=0.0)
    grads = [torch.tensor([[1.0, 3.0], [0.0, 2.0]]), torch.tensor([[2.0, 2.0], [1.0, 1.0]])]
    expected = p.detach().clone()
    total = torch.zeros(2)
    for step, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        g = grad + 0.1 * expected
        total += g.square().mean(dim=1)
        expected -= 0.5 / (1 + (step - 1) * 1.0) * g / total.sqrt().unsqueeze(1)
        torch.testing.assert_close(p.detach(), expected)


def test_row_wise_adagrad_refuses_bad_input() -> None:
    p = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(ValueError, match="RowWiseAdagrad: lr=-1.0 must be >= 0"):
        RowWiseAdagrad([p], lr=-1.0)
    opt = RowWiseAdagrad([p])
    p.grad = torch.ones(2, 2).to_sparse()
    with pytest.raises(ValueError, match="dense gradients"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 2))


@pytest.mark.parametrize(
    ("optimizer_type", "kwargs"),
    [
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
    ],
)
def test_optimizer_type_matches_the_torch_optimizer(
    optimizer_type: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    fused = FusedEmbeddingBagCollection(
        _tables(), optimizer_type=optimizer_type, optimizer_kwargs=kwargs
    )
    fused.load_state_dict(ebc.state_dict())
    opt = optimizer_type(ebc.parameters(), **kwargs)
    for _ in range(3):
        fused(_kjt()).values().square().sum().backward()
        opt.zero_grad()
        ebc(_kjt()).values().square().sum().backward()
        opt.step()
    for key, value in ebc.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[key], value)
    assert fused.fused_optimizer() is fused.fused_optimizer  # TorchRec calls it


def test_fused_config_maps_and_refuses() -> None:
    assert fused_config(torch.optim.Adagrad, {"lr": 0.2}) == FusedOptimizerConfig(
        name="adagrad", lr=0.2, eps=1e-10
    )
    assert fused_config(torch.optim.SGD, {"lr": 0.2, "momentum": 0}).name == "sgd"
    for torch_type in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam):
        default = inspect.signature(torch_type.__init__).parameters["lr"].default
        assert fused_config(torch_type).lr == default, torch_type  # SGD's was 10x torch's
    sparse_adam = fused_config(torch.optim.SparseAdam, {"betas": [0.8, 0.9]})
    assert sparse_adam.name == "adam" and sparse_adam.betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="optimizer_type Adam has no fused embedding kernel"):
        fused_config(torch.optim.Adam)
    with pytest.raises(ValueError, match=r"optimizer_kwargs\['momentum'\]=0.9: the fused sgd"):
        fused_config(torch.optim.SGD, {"momentum": 0.9})
    with pytest.raises(ValueError, match="optimizer= .* or optimizer_type= .*not both"):
        FusedEmbeddingBagCollection(
            _tables(), optimizer=FusedOptimizerConfig(name="sgd"), optimizer_type=torch.optim.SGD
        )


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleDict({"ebc": EmbeddingBagCollection(_tables())})
        self.ebc = EmbeddingBagCollection(_tables(), is_weighted=True)
        self.dense = nn.Linear(12, 1)


def test_fuse_embedding_optimizer_replaces_every_collection() -> None:
    torch.manual_seed(0)
    model = _Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    assert fuse_embedding_optimizer(model, torch.optim.SGD, {"lr": 0.5}) is model
    assert isinstance(model.ebc, FusedEmbeddingBagCollection) and model.ebc.is_weighted
    assert isinstance(model.inner["ebc"], FusedEmbeddingBagCollection)
    assert [n for n, _ in model.named_parameters()] == names
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    alone = fuse_embedding_optimizer(EmbeddingBagCollection(_tables()), torch.optim.Adagrad)
    assert isinstance(alone, FusedEmbeddingBagCollection)
    assert alone.fused_optimizer.param_groups[0]["optimizer"] == "adagrad"


def test_in_backward_optimizer_filter() -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(_tables())
    _apply_optimizer_in_backward(
        torch.optim.SGD, ebc.embedding_bags["t0"].parameters(), optimizer_kwargs={"lr": 1.0}
    )
    inside = dict(in_backward_optimizer_filter(ebc.named_parameters(), include=True))
    outside = dict(in_backward_optimizer_filter(ebc.named_parameters(), include=False))
    assert set(inside) == {"embedding_bags.t0.weight"}
    assert set(outside) == {"embedding_bags.t1.weight"}
    # TorchRec's default: the parameters without an in-backward optimizer (the dense ones).
    assert dict(in_backward_optimizer_filter(ebc.named_parameters())) == outside
