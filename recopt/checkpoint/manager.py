"""`CheckpointManager`: numbered checkpoints under one root, the newest K kept.

Each save goes to ``<root>/step_<N>`` through `save`'s atomic rename; older checkpoints are
deleted only after the new one is complete, so a good checkpoint exists at every moment. The
newest checkpoint whose tensors are all finite is never rotated away, one run owns its root
(another run's checkpoints are refused unless resuming or overwriting), and a lock file keeps
a second writer out.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from recopt.checkpoint.manifest import MANIFEST_NAME, read_manifest
from recopt.checkpoint.save_load import DEFAULT_TIMEOUT, Optimizers, load, save
from recopt.checkpoint.state import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d+)$")
# A checkpoint being replaced (`save(..., overwrite=True)`) sits here between two renames.
_REPLACED_DIR = re.compile(r"^\.step_(\d+)\.old$")


class CheckpointManager:
    """Saves ``step_<N>`` checkpoints under ``root`` and keeps the last ``keep_last``.

    Beyond the last ``keep_last``, the newest checkpoint whose tensors were all finite when
    saved is kept too, so that a run that diverged (NaN/inf weights) can always go back to
    good weights. Each rank holds an exclusive lock on ``root/.lock.rank<r>`` from
    construction to `close` (or process exit), so two runs cannot write the same root.
    Use it as a context manager, or call `close` when the run ends.

    Args:
        root: the directory holding the checkpoints (created here).
        keep_last: how many complete checkpoints to keep (at least 1).
        timeout: limit for every collective of a save or load.
        resume: this run continues from the checkpoints already in ``root``.
        overwrite: ``root`` may hold another run's checkpoints: they are deleted once this
            run's first checkpoint is complete.

    Raises:
        ValueError: ``keep_last`` is below 1.
        CheckpointError: ``root`` holds checkpoints and neither ``resume`` nor ``overwrite``
            was given, or another process holds its lock.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 3,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        *,
        resume: bool = False,
        overwrite: bool = False,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.timeout = timeout
        self._lock: _RootLock | None = _RootLock(self.root, _rank())
        try:
            found = self.complete()
            if found and not resume and not overwrite:
                raise CheckpointError(
                    f"{self.root} holds checkpoints of another run (steps "
                    f"{[step for step, _ in found]}); a new run would rotate them away or "
                    "overwrite them. To continue from them pass resume=True (the DLRM "
                    "script: --resume); to replace them pass overwrite=True (the DLRM script: "
                    "--overwrite-checkpoints); or use another directory"
                )
        except BaseException:
            self.close()
            raise
        self._foreign = [path for _, path in found] if overwrite and not resume else []

    def close(self) -> None:
        """Release the directory lock (also released when the process exits)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint (one with a manifest), oldest first.

        A step whose re-save died between moving the old copy aside and renaming the new one
        into place is found in that old copy (``.step_<n>.old``), which the next save of the
        step then replaces.
        """
        if not self.root.is_dir():
            return []
        found: dict[int, Path] = {}
        for child in sorted(self.root.iterdir(), key=lambda c: c.name.startswith(".")):
            match = _STEP_DIR.match(child.name) or _REPLACED_DIR.match(child.name)
            if match and (child / MANIFEST_NAME).is_file():
                found.setdefault(int(match.group(1)), child)  # (step_<n> itself first)
        return sorted(found.items())

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
        if _rank() == 0:
            for old in self._foreign:
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
            for old in self._rotated():
                shutil.rmtree(old, ignore_errors=True)
        self._foreign = []
        return path

    def _rotated(self) -> list[Path]:
        """Checkpoints beyond the last K, less the newest finite one if none of the K is."""
        found = [path for _, path in self.complete()]
        kept, older = found[-self.keep_last :], found[: -self.keep_last]
        if older and not any(_finite(path) for path in kept):
            for path in reversed(older):
                if _finite(path):
                    older.remove(path)
                    break
        return older

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


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _finite(path: Path) -> bool:
    # Checkpoints written before the manifest recorded finiteness count as finite.
    try:
        return read_manifest(path).finite is not False
    except CheckpointError:
        return False


class _RootLock:
    """This rank's exclusive ``flock`` on ``root/.lock.rank<r>``; the file holds the pid.

    The file is removed on `close` (and ``root`` too if the lock created it and it is still
    empty). A process that opened the file just before its removal would lock a deleted
    file, so a lock counts only if the path still names the locked file.
    """

    def __init__(self, root: Path, rank: int) -> None:
        self._created_root = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f".lock.rank{rank}"
        while True:
            file = open(self.path, "a+")  # noqa: SIM115 - held open until close()
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "unknown"
                file.close()
                raise CheckpointError(
                    f"{root} is in use by another run (pid {holder} holds {self.path}); two "
                    "runs writing one checkpoint directory overwrite each other: wait for "
                    "it, stop it, or use another directory"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()  # removed by its holder meanwhile: lock the new one
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        self._file: IO[str] | None = file

    def close(self) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)
            self._file.close()
            self._file = None
            if self._created_root:
                try:
                    self.path.parent.rmdir()
                except OSError:
                    pass  # not empty: it holds checkpoints (or another rank's lock)
