"""The contract every fused embedding collection shares, declared once.

`FusedEmbeddingBagCollection`, `FusedEmbeddingCollection` and their sharded twins update their
tables inside backward and expose the same surface; DMP, fault tolerance and checkpointing
recognise a fused collection by this Protocol (not by an ABC, a name test or ``getattr``).
It extends the kernels' `KernelOwner` (``kernels()``, what `flush_kernel_caches` needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from recopt.kernels.contract import Kernel, KernelOwner
from recopt.modules.config import BaseEmbeddingConfig
from recopt.optim.keyed import KeyedOptimizer


@runtime_checkable
class FusedCollection(KernelOwner, Protocol):
    """A module whose tables run on kernels that apply their optimizer inside backward.

    Attributes:
        tables: the collection's table configs (every table, also those held on other ranks).
    """

    tables: Sequence[BaseEmbeddingConfig]

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """Params ``<prefix>.<table>.weight`` and their in-backward state (docs/design.md)."""
        ...

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a NaN/inf output gradient skips the fused update."""
        ...

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes whose fused update was skipped for a NaN/inf output gradient."""
        ...

    def kernels(self) -> list[Kernel]:
        """This rank's kernels."""
        ...

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        ...
