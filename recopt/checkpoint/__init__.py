"""Checkpoints: atomic, verified DCP save/load at any world size and plan, and resharding.

See docs/checkpoint.md for the layout, the trust model and the ``recopt-reshard`` tool.
"""

from recopt.checkpoint.manager import CheckpointManager
from recopt.checkpoint.manifest import Manifest, read_manifest
from recopt.checkpoint.reshard import export_full, reshard
from recopt.checkpoint.reshard_report import ReshardReport
from recopt.checkpoint.save_load import load, save
from recopt.checkpoint.state import CheckpointError, Stateful

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "Manifest",
    "ReshardReport",
    "Stateful",
    "export_full",
    "load",
    "read_manifest",
    "reshard",
    "save",
]
