"""Guards of a save or load: rollback of a failed load, a full disk named, finiteness.

A load that fails after verification must leave live state as it was (`Backup`); a save that
fails on a full disk must say so and how much it needed (`write_failure`); each manifest
records whether the saved tensors were finite (`all_finite`) for `CheckpointManager`.
"""

from __future__ import annotations

import errno
import math
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from recopt.checkpoint.state import TensorLike, global_shape, tensor_dtype


class Backup:
    """Copies of this rank's live tensors (local shards only), to restore after a failed load."""

    def __init__(self, tensors: Mapping[str, TensorLike]) -> None:
        self._pairs = [(t, t.detach().clone()) for t in local_parts(tensors.values())]

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in self._pairs:
            live.copy_(saved)


def local_parts(tensors: Iterable[TensorLike]) -> list[torch.Tensor]:
    parts: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, ShardedTensor):
            parts += [shard.tensor for shard in t.local_shards()]
        else:
            parts.append(t)
    return parts


@torch.no_grad()
def all_finite(tensors: Iterable[TensorLike]) -> bool:
    """Whether this rank's floating-point tensors (its local shards) hold no NaN or inf."""
    return all(
        bool(torch.isfinite(t).all())
        for t in local_parts(tensors)
        if t.is_floating_point() or t.is_complex()
    )


def write_failure(
    error: BaseException, rank: int, final: Path, partial: Path, tensors: Mapping[str, TensorLike]
) -> str:
    """One line on why a save failed; a full disk is named as such, with the bytes needed."""
    if not is_no_space(error):
        return f"rank {rank}: {type(error).__name__}: {error}"
    needed = sum(math.prod(global_shape(t)) * tensor_dtype(t).itemsize for t in tensors.values())
    try:
        free = f"{shutil.disk_usage(final.parent).free} bytes free"
    except OSError:
        free = "free space unknown"
    return (
        f"no space left on device writing {partial} (for {final}): the checkpoint needs "
        f"about {needed} bytes of tensors, {free}; the partial checkpoint was removed and "
        "the previous checkpoints are kept; free space or save elsewhere"
    )


def is_no_space(error: BaseException | None, depth: int = 0) -> bool:
    """Whether ``error``, its causes, or (for DCP's CheckpointException) any rank's failure is
    an ``ENOSPC`` OSError."""
    if error is None or depth > 8:
        return False
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and is_no_space(inner, depth + 1):
                return True
    return is_no_space(error.__cause__, depth + 1) or is_no_space(error.__context__, depth + 1)
