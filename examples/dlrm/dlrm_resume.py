"""Which checkpoint the DLRM script's ``--resume`` loads, and where the run may write its own.

``--resume`` alone continues from the run's checkpoint directory; ``--resume PATH`` from a
step folder (``step_<N>``, or a checkpoint written by ``recopt-reshard``) or from another
checkpoints folder. In a folder the newest checkpoint whose tensors were all finite is taken
(a diverged run's last checkpoints hold NaN/inf and would diverge again), and the ones passed
over are named. A checkpoint is never used as the directory the run writes into.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from recopt.checkpoint import CheckpointError, read_manifest
from recopt.checkpoint.manifest import MANIFEST_NAME

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to load and the newer ones passed over for NaN/inf tensors."""

    path: Path
    skipped_nonfinite: tuple[Path, ...] = ()


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (a step folder), not a folder of them."""
    return (path / MANIFEST_NAME).is_file()


def _finite(path: Path) -> bool:
    # A checkpoint of a recopt that did not record finiteness counts as finite.
    try:
        return read_manifest(path).finite is not False
    except CheckpointError:
        return False


def find_resume_point(source: Path) -> ResumePoint | None:
    """The checkpoint ``--resume`` loads from ``source``.

    Args:
        source: a checkpoint (loaded as it is, finite or not: it was named) or a folder of
            ``step_<N>`` checkpoints (the newest finite one).

    Returns:
        The choice, or None when ``source`` holds no complete checkpoint.

    Raises:
        ValueError: every checkpoint in the folder holds NaN/inf (the fix: name one).
    """
    if is_checkpoint(source):
        return ResumePoint(source)
    if not source.is_dir():
        return None
    found = sorted(
        (int(match.group(1)), child)
        for child in source.iterdir()
        if (match := _STEP_DIR.match(child.name)) and is_checkpoint(child)
    )
    skipped: list[Path] = []
    for _, path in reversed(found):
        if _finite(path):
            return ResumePoint(path, tuple(skipped))
        skipped.append(path)
    if skipped:
        names = ", ".join(p.name for p in skipped)
        raise ValueError(
            f"--resume: every checkpoint in {source} holds NaN or inf weights or optimizer "
            f"state ({names}); the run had diverged before any of them. Start afresh, or load "
            f"one anyway by naming it: --resume {skipped[0]}"
        )
    return None


def check_writable_root(root: Path) -> None:
    """Refuses a checkpoint directory that is itself one checkpoint (e.g. a reshard's output).

    Raises:
        ValueError: naming the directory and the fix.
    """
    if is_checkpoint(root):
        raise ValueError(
            f"checkpoint.dir {root} is one checkpoint (a step folder, such as recopt-reshard "
            "writes), not a folder of step_<N> checkpoints, and this run would write its own "
            f"checkpoints into it. Resume from it with --resume {root}, and leave "
            "checkpoint.dir unset (<output_dir>/checkpoints) or name another folder"
        )
