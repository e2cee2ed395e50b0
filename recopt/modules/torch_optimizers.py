"""Fused embedding optimizers named the TorchRec way: a torch optimizer class and its kwargs.

``FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.Adagrad,
optimizer_kwargs={"lr": 0.1})`` and `fused.fuse_embedding_optimizer` map the class to the fused
kernel with the same update (and torch's defaults for that class), so TorchRec code builds
the same model; a class or keyword with no fused equivalent is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.registry import ADAGRAD, ADAM, ROW_WISE_ADAGRAD, SGD
from recopt.optim.rowwise_adagrad import RowWiseAdagrad

# torch class -> (fused optimizer, torch's defaults where they differ from the fused ones,
# the kwargs the fused kernel implements).
_FUSED_EQUIVALENT: dict[type, tuple[str, dict[str, Any], set[str]]] = {
    torch.optim.SGD: (SGD.name, {"lr": 1e-3}, {"lr", "weight_decay", "maximize"}),
    torch.optim.Adagrad: (ADAGRAD.name, {"eps": 1e-10}, {"lr", "eps", "weight_decay", "maximize"}),
    RowWiseAdagrad: (
        ROW_WISE_ADAGRAD.name,
        {"eps": 1e-10},
        {"lr", "eps", "weight_decay", "maximize"},
    ),
    torch.optim.SparseAdam: (ADAM.name, {}, {"lr", "eps", "betas", "maximize"}),
}
# Keywords whose default value is the only one the fused kernels implement.
_DEFAULT_ONLY: dict[str, Any] = {"momentum": 0, "dampening": 0, "nesterov": False, "lr_decay": 0}
_DEFAULT_ONLY.update({"initial_accumulator_value": 0, "foreach": None, "differentiable": False})


def fused_config(
    optimizer_type: type, optimizer_kwargs: Mapping[str, Any] | None = None
) -> FusedOptimizerConfig:
    """The fused optimizer that applies ``optimizer_type(params, **optimizer_kwargs)``'s update.

    As every fused kernel, it updates only the rows a batch looks up: with ``weight_decay``
    the rows not looked up are not decayed (the torch optimizer decays every row).

    Raises:
        ValueError: a class with no fused kernel, or a keyword the kernel does not implement
            (each message names it and what is supported).
    """
    if optimizer_type not in _FUSED_EQUIVALENT:
        known = ", ".join(sorted(t.__name__ for t in _FUSED_EQUIVALENT))
        raise ValueError(
            f"optimizer_type {getattr(optimizer_type, '__name__', optimizer_type)} has no fused "
            f"embedding kernel; use one of {known}, or FusedOptimizerConfig for the others "
            "(every fused optimizer of recopt.kernels.registry)"
        )
    name, defaults, supported = _FUSED_EQUIVALENT[optimizer_type]
    kwargs = dict(optimizer_kwargs or {})
    for key, value in list(kwargs.items()):
        if key in _DEFAULT_ONLY and value == _DEFAULT_ONLY[key]:
            del kwargs[key]
        elif key not in supported:
            raise ValueError(
                f"optimizer_kwargs[{key!r}]={value!r}: the fused {name} kernel does not "
                f"implement it for {optimizer_type.__name__}; it takes {sorted(supported)}"
            )
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return FusedOptimizerConfig(name=name, **{**defaults, **kwargs})
