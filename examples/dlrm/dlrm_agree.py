"""Every rank of the DLRM script must run the same config: checked once, before any work.

Ranks launched with different ``--set`` values (another optimizer, a 10x lr on one rank)
used to train "successfully" into a checkpoint that neither config can load. At start each
rank hashes its resolved config; the ranks exchange the flattened configs
(`comm.all_gather_bytes`: two all-gathers, each with a timeout) and, if any differs, every
rank raises naming the differing keys.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any

import torch.distributed as dist
from dlrm_config import TrainingConfig

from recopt import comm
from recopt.config import to_plain

_SHOWN = 8  # differing keys named in the error


def flat_config(config: TrainingConfig) -> dict[str, str]:
    """``section.key`` -> the value as JSON text, for every leaf of the resolved config."""
    flat: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for name, item in value.items():
                walk(item, f"{key}.{name}" if key else str(name))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                walk(item, f"{key}.{i}")
        else:
            flat[key] = json.dumps(value, sort_keys=True, default=str)

    walk(to_plain(config), "")
    return flat


def config_digest(flat: dict[str, str]) -> str:
    """SHA-256 of the flattened config (key order does not matter)."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def check_same_config(config: TrainingConfig, timeout: datetime.timedelta) -> None:
    """Raises on every rank unless every rank of the default group runs this config.

    Args:
        config: this rank's resolved config.
        timeout: limit for each of the two all-gathers.

    Raises:
        ValueError: naming the keys that differ and each rank's value of them.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = flat_config(config)
    mine = json.dumps({"digest": config_digest(flat), "config": flat}).encode()
    received = [json.loads(part) for part in comm.all_gather_bytes(mine, None, timeout)]
    if len({r["digest"] for r in received}) == 1:
        return
    configs: list[dict[str, str]] = [r["config"] for r in received]
    keys = sorted(set().union(*configs))
    differing = [k for k in keys if len({c.get(k, "(unset)") for c in configs}) > 1]
    lines = [
        f"{key}: " + ", ".join(f"rank {r} = {c.get(key, '(unset)')}" for r, c in enumerate(configs))
        for key in differing[:_SHOWN]
    ]
    more = f" (and {len(differing) - _SHOWN} more)" if len(differing) > _SHOWN else ""
    raise ValueError(
        f"the ranks run different configs; {len(differing)} key(s) differ{more}: "
        + "; ".join(lines)
        + ". Launch every rank with the same --config file and --set overrides"
    )
