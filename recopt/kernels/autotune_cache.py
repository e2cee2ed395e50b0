"""The on-disk cache of measured backend decisions (`recopt.kernels.autotune`).

One JSON file, ``backend_choices.json``: machine key (CPU or GPU model, torch and fbgemm
versions) -> shape-class key -> decision. A file that cannot be read is ignored with a warning
and rewritten; writes go through a temporary file, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from recopt.kernels.contract import BackendDecision

CACHE_FILE = "backend_choices.json"
CACHE_VERSION = 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` where that file is missing)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fbgemm_version() -> str:
    """The installed fbgemm package's version, ``none`` without one."""
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu"):
        try:
            return f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "none"


def machine_key(device: str) -> str:
    """What a decision is valid for: the device model, torch and fbgemm versions."""
    if device == "cuda" and torch.cuda.is_available():
        model = torch.cuda.get_device_name()
    else:
        model = f"{cpu_model()} x{os.cpu_count()}"
    return f"{device}:{model}|torch=={torch.__version__}|{fbgemm_version()}"


class DecisionCache:
    """The decisions recorded for one machine key, in ``directory/backend_choices.json``.

    Args:
        directory: the cache directory (created on the first write).
        machine: the machine key (`machine_key`).
    """

    def __init__(self, directory: Path, machine: str) -> None:
        self.path = Path(directory) / CACHE_FILE
        self.machine = machine

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
                raise ValueError(f"not a version-{CACHE_VERSION} decision cache")
            if not isinstance(data.get("machines"), dict):
                raise ValueError("no 'machines' object")
            return data
        except (OSError, ValueError) as err:
            warnings.warn(
                f"ignoring the backend decision cache {self.path} ({err}); AUTO measures "
                "again and rewrites it",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}

    def get(self, key: str) -> BackendDecision | None:
        """The decision recorded for ``key`` on this machine, or ``None``."""
        try:
            entry = self._load().get("machines", {}).get(self.machine, {}).get(key)
            return None if entry is None else BackendDecision.from_json(entry)
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            warnings.warn(
                f"ignoring entry {key!r} of {self.path} ({err}); AUTO measures again",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def put(self, key: str, decision: BackendDecision) -> None:
        """Record ``decision`` for ``key`` (an unwritable directory only warns)."""
        data = self._load() or {"version": CACHE_VERSION, "machines": {}}
        data["machines"].setdefault(self.machine, {})[key] = decision.to_json()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".backend_choices.")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as err:
            warnings.warn(
                f"cannot write the backend decision cache {self.path} ({err})",
                RuntimeWarning,
                stacklevel=2,
            )
