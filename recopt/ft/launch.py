"""One call to make a training loop fault tolerant: Manager, optimizer, embedding guards.

`make_fault_tolerant(model, optimizer, config)` is what a training script's
``--fault-tolerant`` flag calls; `fault_tolerance_config_from_env` reads the launcher's
variables (entry points pass ``os.environ`` in). The loop then calls ``optimizer.zero_grad()``
BEFORE the forward pass (the quorum may heal the model), and ``optimizer.step()`` after
backward.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.ft.embedding import FusedEmbeddingGuard
from recopt.ft.healing_state import into_local_shards, to_local_shards
from recopt.ft.optim import FaultTolerantOptimizer
from recopt.ft.replica_sync import EmbeddingReplicaSync
from recopt.ft.torchft_manager import TorchftConfig, TorchftManager, torchft_config_from_env
from recopt.modules.collection import FusedCollection

# recopt's retired lighthouse's variable: refused with what to set instead.
RETIRED_LIGHTHOUSE = "RECOPT_FT_LIGHTHOUSE"


@dataclasses.dataclass(slots=True)
class FaultTolerantTraining:
    """What `make_fault_tolerant` built; ``optimizer`` replaces the loop's optimizer."""

    manager: TorchftManager
    optimizer: FaultTolerantOptimizer
    guards: list[FusedEmbeddingGuard] = dataclasses.field(default_factory=list)
    syncs: list[EmbeddingReplicaSync] = dataclasses.field(default_factory=list)

    def shutdown(self) -> None:
        """Leave the torchft job (manager and healing servers), detach the guards."""
        for guard in self.guards:
            guard.remove()
        self.manager.shutdown()


def fault_tolerance_config_from_env(
    environ: Mapping[str, str], *, timeout: datetime.timedelta = datetime.timedelta(seconds=60)
) -> TorchftConfig:
    """This replica group's torchft settings (`torchft_config_from_env`); an environment
    still naming recopt's retired lighthouse is refused with the variables to use instead.

    Raises:
        ImportError: torchft is not installed (names the extra ``recopt[ft]``).
        ValueError: a variable is missing or malformed, or ``RECOPT_FT_LIGHTHOUSE`` is set
            (the message names it).
    """
    if environ.get(RETIRED_LIGHTHOUSE):
        raise ValueError(
            f"{RETIRED_LIGHTHOUSE}={environ[RETIRED_LIGHTHOUSE]!r} names recopt's own "
            "lighthouse, which is retired: start `torchft_lighthouse --bind [::]:29510 "
            "--min_replicas N` and set TORCHFT_LIGHTHOUSE=http://host:29510 and "
            "REPLICA_GROUP_ID instead (docs/fault_tolerance.md)"
        )
    return torchft_config_from_env(environ, timeout=timeout)


def _fused_collections(model: nn.Module) -> list[nn.Module]:
    """The embedding collections whose optimizer runs inside backward (both twins)."""
    return [m for m in model.modules() if isinstance(m, FusedCollection)]


def _healing_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, extras: Mapping[str, Any]
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """The Manager's state callbacks: what a healthy replica serves and a healer loads."""

    def state_dict() -> dict[str, Any]:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        state |= {f"extra.{k}": v.state_dict() for k, v in extras.items()}
        return dict(to_local_shards(state))  # sharded tables: this rank's shards, plain

    def load_state_dict(state: dict[str, Any]) -> None:
        # Local shards are copied into this rank's ShardedTensors, which are then loaded.
        model.load_state_dict(into_local_shards(state["model"], model.state_dict()))
        optimizer.load_state_dict(into_local_shards(state["optimizer"], optimizer.state_dict()))
        for k, v in extras.items():
            v.load_state_dict(state[f"extra.{k}"])

    return state_dict, load_state_dict


def make_fault_tolerant(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TorchftConfig,
    *,
    sync_embeddings: bool = True,
    extra_state: Mapping[str, Any] | None = None,
) -> FaultTolerantTraining:
    """Wrap a model and its optimizer for fault-tolerant training across replica groups.

    Every fused embedding collection in ``model`` gets a `FusedEmbeddingGuard` (its
    in-backward updates are rolled back when a step is dropped). A replica that (re)joins
    behind the others receives ``model.state_dict()``, ``optimizer.state_dict()`` and the
    ``state_dict()`` of each ``extra_state`` object (e.g. an LR scheduler) from a peer.
    Data-loader positions are not healed: each replica group reads its own data.

    Args:
        model: the whole model (one full copy per replica group).
        optimizer: its optimizer, e.g. a CombinedOptimizer of fused and dense parts; its
            dense parameters' gradients are averaged over the replica groups.
        config: this replica group's torchft settings (`TorchftManager`). The first quorum
            waits for the lighthouse's ``--min_replicas`` groups.
        sync_embeddings: keep fused tables identical across replica groups
            (`EmbeddingReplicaSync`, needs kernels with ``grad_hook``); False lets each
            replica group train its own tables (healing still copies them).
        extra_state: name -> object with ``state_dict``/``load_state_dict``, healed too.

    Returns:
        The manager, the optimizer to use in the loop, and the guards.

    Raises:
        ValueError: ``sync_embeddings`` with a kernel that cannot take part (no hook), or
            with id-mapped tables it cannot keep equal (``init_fn``; a sharded collection).
        ImportError: torchft is not installed (names the extra).
    """
    extras = dict(extra_state or {})
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):
        init_state()  # strict in-place loaders need the lazily created state on both sides

    state_dict, load_state_dict = _healing_state(model, optimizer, extras)
    manager = TorchftManager(config, state_dict=state_dict, load_state_dict=load_state_dict)
    guards, syncs = [], []
    try:
        for module in _fused_collections(model):
            guards.append(FusedEmbeddingGuard(module, manager))
            if sync_embeddings:
                syncs.append(EmbeddingReplicaSync(module, manager, guards[-1]))
    except ValueError:
        manager.shutdown()
        raise
    return FaultTolerantTraining(manager, FaultTolerantOptimizer(manager, optimizer), guards, syncs)


def state_digest(*states: Any) -> str:
    """SHA-256 over nested state dicts: replica groups that agree have equal digests.

    Covers tensor bytes, dtypes and shapes, dict keys (sorted) and plain values; a
    ShardedTensor contributes its local shards, so ranks compare with the same rank elsewhere.

    Args:
        states: e.g. ``model.state_dict()`` and ``optimizer.state_dict()``.

    Returns:
        The hex digest.
    """
    hasher = hashlib.sha256()

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                hasher.update(repr(key).encode())
                visit(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, ShardedTensor):
            visit([shard.tensor for shard in value.local_shards()])
        elif isinstance(value, torch.Tensor):
            plain = value.detach().cpu().contiguous().reshape(-1)
            hasher.update(f"{value.dtype}{tuple(value.shape)}".encode())
            hasher.update(plain.view(torch.uint8).numpy().tobytes())
        else:
            hasher.update(repr(value).encode())

    for state in states:
        visit(state)
    return hasher.hexdigest()
