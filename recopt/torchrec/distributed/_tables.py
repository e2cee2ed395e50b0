"""What the planner and DMP adapters read from a model: its embedding modules' tables, and
each table's fused optimizer as TorchRec code chose it (applied in backward, else the
sharder's ``fused_params``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.sharding.model_parallel import _embedding_modules, _table_optimizers
from recopt.torchrec.distributed.types import ModuleSharder


def tables_by_module(module: nn.Module) -> dict[str, list[Any]]:
    """Module path -> the tables of every embedding collection DMP would shard."""
    return {path: list(m.tables) for path, m in _embedding_modules(module)}


def sharder_for(
    module: nn.Module, sharders: Sequence[ModuleSharder] | None
) -> ModuleSharder | None:
    """The first sharder handling ``module``'s type, if any."""
    return next((s for s in sharders or () if s.shards(module)), None)


def table_optimizers(
    module: nn.Module, sharders: Sequence[ModuleSharder] | None
) -> dict[str, dict[str, FusedOptimizerConfig]]:
    """Module path -> table -> its fused optimizer: a fused module's own, or the one
    applied in backward, else its sharder's ``fused_params`` optimizer (none: the default).

    Raises:
        ValueError: an in-backward optimizer with no fused equivalent (naming it).
    """
    result: dict[str, dict[str, FusedOptimizerConfig]] = {}
    for path, m in _embedding_modules(module):
        chosen = _table_optimizers(m)
        sharder = sharder_for(m, sharders)
        if sharder is not None and sharder.optimizer is not None:
            chosen = {t.name: chosen.get(t.name, sharder.optimizer) for t in m.tables}
        result[path] = chosen
    return result
