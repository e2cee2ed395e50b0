"""The stages of a checkpoint load between verification and DCP's read, apart from `load`.

`compare_tensors` / `compare_names` find every mismatch before anything changes;
`decode_trees` rebuilds the saved trees around the load targets; `apply_trees` puts them into
the live objects while recording how to undo it, so a failed load leaves them as they were.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from recopt.checkpoint.manifest import Manifest, TensorEntry
from recopt.checkpoint.state import (
    CheckpointError,
    Stateful,
    TensorLike,
    capture_rng,
    decode_tree,
    dtype_name,
    encode_tree,
    global_shape,
    restore_rng,
    subtree,
    tensor_dtype,
    to_optimizer_keys,
)
from recopt.kernels.updates import ROUNDING_STEP

# Messages keep the logger name they had when this code lived in save_load.py.
logger = logging.getLogger("recopt.checkpoint.save_load")
Optimizers = torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]


def init_optimizer_state(optimizer: Optimizers) -> None:
    # KeyedOptimizers load by copying into existing state, which torch creates lazily at the
    # first step; init_state() creates it (no-op where it exists) without changing weights.
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer.values()
    for opt in optimizers:
        init_state = getattr(opt, "init_state", None)
        if callable(init_state):
            init_state()


def _top(skeleton: Any) -> list[str]:
    return [k for k, _ in skeleton.get("d", [])]


def compare_names(
    skeleton: Any, optimizer: Optimizers | None, extra: Mapping[str, Any]
) -> list[str]:
    """Optimizer names and stateful extras the caller expects but the checkpoint lacks."""
    problems = []
    node = subtree(skeleton, "optim")
    if optimizer is not None and node is not None and isinstance(optimizer, Mapping):
        saved = set(_top(node))
        if saved != set(optimizer):
            problems.append(
                f"the checkpoint holds optimizers {sorted(saved)}, the caller gave "
                f"{sorted(optimizer)}; pass the same names as when saving"
            )
    saved_extra = set(_top(subtree(skeleton, "extra") or {}))
    for name, obj in extra.items():
        if isinstance(obj, Stateful) and name not in saved_extra:
            problems.append(
                f"the checkpoint has no extra {name!r} to restore (it has {sorted(saved_extra)})"
            )
    return problems


def empty_tensor(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))


def compare_tensors(
    manifest: Manifest, skeleton: Any, live: dict[str, Any], directory: Path
) -> tuple[list[str], dict[str, TensorLike]]:
    """Keys and shapes of the live model/optimizer against the checkpoint's.

    Returns:
        The problems found, and the live tensors by manifest key (what the load writes into;
        complete only when there is no problem).
    """
    live_tensors: dict[str, TensorLike] = {}
    if "optim" in live and "optim" not in _top(skeleton):
        return [f"{directory} holds no optimizer state; load it with optimizer=None"], live_tensors
    try:
        encode_tree(live, "", live_tensors)
    except CheckpointError as e:
        return [str(e)], live_tensors
    saved = manifest.tensors
    lacking = [k for k in live_tensors if k not in saved]
    counters = [k for k in lacking if is_optional_state(k)]
    if counters:
        logger.info(
            "%s has no %s for %d tables (saved before recopt kept it, or by tables rounded "
            "otherwise): they load as 0",
            directory,
            ROUNDING_STEP,
            len(counters),
        )
    missing = sorted(k for k in lacking if not is_optional_state(k))
    unexpected = sorted(k for k in saved if k.startswith("model/") and k not in live_tensors)
    mismatched, converted = [], []
    for key, t in live_tensors.items():
        entry = saved.get(key)
        shape, dtype = global_shape(t), dtype_name(tensor_dtype(t))
        if entry is None or (entry.shape == shape and entry.dtype == dtype):
            continue
        if entry.shape == shape and {entry.dtype, dtype} <= CONVERTIBLE_DTYPES:
            converted.append(f"{key}: {entry.dtype} -> {dtype}")
        else:
            mismatched.append(
                f"{key}: checkpoint {entry.shape} {entry.dtype}, model {shape} {dtype}"
            )
    if converted:
        _warn_conversion(converted)
    problems = []
    if missing:
        problems.append(f"keys the checkpoint lacks: {_listing(missing)}")
    if unexpected:
        problems.append(f"keys the model lacks: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape/dtype mismatches: {_listing(mismatched)}")
    if problems:
        problems.append(
            "the checkpoint is of another model (or another optimizer); load it into the "
            "model that saved it, or convert it with recopt-reshard --to-full"
        )
    return problems, live_tensors


def is_optional_state(key: str) -> bool:
    """Optimizer state a checkpoint may lack, or hold for a model that keeps none: the fused
    tables' ``rounding_step`` pass counters (the fused optimizers load a lacking one as 0 and
    drop an excess one; docs/checkpoint.md, "Dtypes")."""
    return key.startswith("optim/") and key.endswith(f".{ROUNDING_STEP}")


# Float storages a load converts between (the model's dtype wins; copy rounds to nearest).
CONVERTIBLE_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def _warn_conversion(converted: list[str]) -> None:
    message = (
        f"loading converts {len(converted)} tensors to the model's dtype (rounded to nearest): "
        f"{_listing(converted)}; build the model with the checkpoint's weight_dtype / "
        "state_dtype to load them unchanged"
    )
    warnings.warn(message, UserWarning, stacklevel=3)


def _listing(items: list[str], limit: int = 20) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def decode_trees(
    skeleton: Any,
    targets: Mapping[str, TensorLike],
    model: torch.nn.Module,
    optimizer: Optimizers | None,
) -> dict[str, Any]:
    """Every saved tree rebuilt around ``targets`` (filled later, in place), optimizer state
    mapped back to this optimizer's keys: all that can fail before live state changes."""
    decoded: dict[str, Any] = {"model": decode_tree(subtree(skeleton, "model"), targets)}
    if optimizer is not None:
        saved = decode_tree(subtree(skeleton, "optim"), targets)
        if isinstance(optimizer, torch.optim.Optimizer):
            decoded["optim"] = to_optimizer_keys(saved, optimizer, model)
        else:
            decoded["optim"] = {
                name: to_optimizer_keys(saved[name], opt, model) for name, opt in optimizer.items()
            }
    node = subtree(skeleton, "extra")
    decoded["extra"] = {} if node is None else decode_tree(node, targets)
    return decoded


def apply_trees(
    decoded: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Optimizers | None,
    extra: Mapping[str, Any],
    rank_state: dict[str, Any] | None,
    restore_rng_state: bool,
    undo: list[Callable[[], None]],
    rng_note: str = "",
) -> dict[str, Any]:
    """Load the decoded trees into live objects, recording in ``undo`` how to take it back.

    ``rng_note`` says why a rank may lack saved RNG state (the world sizes), for the warning.
    """
    model.load_state_dict(decoded["model"])
    if optimizer is not None:
        pairs = (
            [(optimizer, decoded["optim"])]
            if isinstance(optimizer, torch.optim.Optimizer)
            else [(opt, decoded["optim"][name]) for name, opt in optimizer.items()]
        )
        for opt, state in pairs:
            undo.append(functools.partial(opt.load_state_dict, opt.state_dict()))
            opt.load_state_dict(state)
    extras: dict[str, Any] = decoded["extra"]
    for name, obj in extra.items():
        if isinstance(obj, Stateful):
            undo.append(functools.partial(obj.load_state_dict, copy.deepcopy(obj.state_dict())))
            obj.load_state_dict(extras[name])
    if restore_rng_state:
        if rank_state is None:
            logger.warning(
                "the checkpoint holds no RNG state for this rank (%s): it keeps its own generators",
                rng_note or "it was saved at another world size",
            )
        else:
            undo.append(functools.partial(restore_rng, capture_rng()))
            restore_rng(rank_state["rng"])
    return extras
