"""``torchrec.distributed.train_pipeline``: recopt's `TrainPipelineSparseDist`, once
`recopt.sharding` offers it."""

from __future__ import annotations

from typing import Any

import recopt.sharding as _sharding

__all__ = [name for name in ("TrainPipelineSparseDist",) if hasattr(_sharding, name)]

if hasattr(_sharding, "TrainPipelineSparseDist"):
    TrainPipelineSparseDist = _sharding.TrainPipelineSparseDist


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"recopt.torchrec.distributed.train_pipeline has no {name!r}; recopt offers "
        f"{__all__ or 'no train pipeline in this version'}"
    )
