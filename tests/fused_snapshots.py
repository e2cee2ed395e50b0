"""Test helpers: a bit-exact snapshot of a fused collection's weights and optimizer state."""

from __future__ import annotations

import torch

from recopt.modules import FusedEmbeddingBagCollection


def snapshot(ebc: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Copies of every weight and every optimizer-state tensor, by name."""
    state = {k: v.clone() for k, v in ebc.state_dict().items()}
    for key, value in ebc.fused_optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            state[f"opt.{key}.{name}"] = tensor.clone()
    return state


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, and every tensor equal bit for bit."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
