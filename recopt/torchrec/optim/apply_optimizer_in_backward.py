"""``torchrec.optim.apply_optimizer_in_backward``: torch's ``_apply_optimizer_in_backward``.

`recopt.sharding.DistributedModelParallel` gives each table so marked the fused optimizer
equal to the class and keyword arguments given here (or refuses it, naming it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.optim import _apply_optimizer_in_backward


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Attach ``optimizer_class(param, **optimizer_kwargs)`` to each parameter, run in backward."""
    _apply_optimizer_in_backward(optimizer_class, params, dict(optimizer_kwargs))
