"""`CheckpointManager`: numbered checkpoints under one root, the newest K kept.

Each save goes to ``<root>/step_<N>`` through `save`'s atomic rename; older checkpoints are
deleted only after the new one is complete, so a good checkpoint exists at every moment.
"""

from __future__ import annotations

import datetime
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recopt.checkpoint.manifest import MANIFEST_NAME, read_manifest
from recopt.checkpoint.save_load import DEFAULT_TIMEOUT, Optimizers, load, save

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Saves ``step_<N>`` checkpoints under ``root`` and keeps the last ``keep_last``.

    Args:
        root: the directory holding the checkpoints (created on first save).
        keep_last: how many complete checkpoints to keep (at least 1).
        timeout: limit for every collective of a save or load.

    Raises:
        ValueError: ``keep_last`` is below 1.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 3,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.timeout = timeout

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint (one with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / MANIFEST_NAME).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None`` if there is none."""
        found = self.complete()
        return found[-1][1] if found else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Optimizers | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        plan_json: str | None = None,
    ) -> Path:
        """Save ``step_<step>`` (all ranks), then delete checkpoints beyond the last K.

        Returns:
            The new checkpoint's directory.
        """
        path = save(
            self.root / f"step_{step:09d}",
            model,
            optimizer,
            extra=extra,
            step=step,
            plan_json=plan_json,
            overwrite=True,
            timeout=self.timeout,
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            for _, old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def load_latest(
        self,
        model: torch.nn.Module,
        optimizer: Optimizers | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest complete checkpoint.

        Returns:
            ``(step, extras)``, or ``None`` when there is no checkpoint yet.
        """
        path = self.latest()
        if path is None:
            return None
        step = read_manifest(path).step
        extras = load(path, model, optimizer, extra=extra, timeout=self.timeout)
        return (step if step is not None else -1), extras
