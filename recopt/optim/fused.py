"""Optimizers whose update runs inside the backward pass, and the modules that own them.

Minimal first version (the optimizer issue completes it).
"""

from __future__ import annotations

import abc
from typing import Any

from recopt.optim.keyed import KeyedOptimizer


class FusedOptimizer(KeyedOptimizer, abc.ABC):
    """A KeyedOptimizer whose update happens in backward; ``step()`` applies no update."""

    @abc.abstractmethod
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        ...

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        ...


class FusedOptimizerModule(abc.ABC):
    """A module that updates its own weights during backward."""

    @property
    @abc.abstractmethod
    def fused_optimizer(self) -> KeyedOptimizer:
        ...
