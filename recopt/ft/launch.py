"""One call to make a training loop fault tolerant: Manager, optimizer, embedding guards.

`make_fault_tolerant(model, optimizer, config)` is what a training script's
``--fault-tolerant`` flag calls; `manager_config_from_env` reads the launcher's variables
(entry points pass ``os.environ`` in). The loop then calls ``optimizer.zero_grad()`` BEFORE
the forward pass (the quorum may heal the model), and ``optimizer.step()`` after backward.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.ft.auth import read_secret
from recopt.ft.client import wait_for_replicas
from recopt.ft.embedding import EmbeddingReplicaSync, FusedEmbeddingGuard
from recopt.ft.healing import into_local_shards, to_local_shards
from recopt.ft.manager import Manager, ManagerConfig
from recopt.ft.optim import FaultTolerantOptimizer
from recopt.ft.steps import StepTransaction
from recopt.ft.torchft_manager import TorchftConfig, TorchftManager, torchft_config_from_env
from recopt.modules.collection import FusedCollection

logger = logging.getLogger(__name__)

ENV_LIGHTHOUSE = "RECOPT_FT_LIGHTHOUSE"  # host:port of the lighthouse
ENV_REPLICA_ID = "RECOPT_FT_REPLICA_ID"  # this replica group's stable name
ENV_MIN_REPLICAS = "RECOPT_FT_MIN_REPLICAS"  # min_replica_size (default 1)
ENV_HOSTNAME = "RECOPT_FT_HOSTNAME"  # name peers heal from (default: loopback)
ENV_BIND_HOST = "RECOPT_FT_BIND_HOST"  # interface the state server listens on (default loopback)


@dataclasses.dataclass(slots=True)
class FaultTolerantTraining:
    """What `make_fault_tolerant` built; ``optimizer`` replaces the loop's optimizer."""

    manager: StepTransaction
    optimizer: FaultTolerantOptimizer
    guards: list[FusedEmbeddingGuard] = dataclasses.field(default_factory=list)
    syncs: list[EmbeddingReplicaSync] = dataclasses.field(default_factory=list)

    def shutdown(self) -> None:
        """Stop heartbeats and the checkpoint server, detach the guards."""
        for guard in self.guards:
            guard.remove()
        self.manager.shutdown()


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port).

    Raises:
        ValueError: not of the form ``host:port`` with an integer port.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"lighthouse address {text!r} is not host:port; e.g. 'node0:29510'")
    return host, int(port)


def manager_config_from_env(
    environ: Mapping[str, str], *, timeout: datetime.timedelta = datetime.timedelta(seconds=60)
) -> ManagerConfig:
    """Manager settings from the environment of one process of a replica group.

    Reads ``RECOPT_FT_LIGHTHOUSE``, ``RECOPT_FT_REPLICA_ID``, ``RECOPT_FT_MIN_REPLICAS``,
    ``RECOPT_FT_HOSTNAME`` (the name peers reach this process's checkpoint server by; default
    loopback), ``RECOPT_FT_BIND_HOST`` (the interface it listens on; default loopback), the
    shared secret (``RECOPT_FT_SECRET``, or a file named by ``RECOPT_FT_SECRET_FILE``) and
    torchrun's ``RANK`` / ``WORLD_SIZE`` (torchrun runs one replica group, so they are the
    rank inside the group and its size).

    Args:
        environ: the entry point's ``os.environ``.
        timeout: limit of every collective, vote and healing transfer.

    Raises:
        ValueError: a variable is missing or malformed (the message names it).
    """
    for name in (ENV_LIGHTHOUSE, ENV_REPLICA_ID):
        if not environ.get(name):
            raise ValueError(
                f"{name} is not set; --fault-tolerant needs {ENV_LIGHTHOUSE}=host:port (from "
                f"`python -m recopt.ft.lighthouse`) and a unique {ENV_REPLICA_ID} per replica group"
            )
    numbers = {}
    for name, default in ((ENV_MIN_REPLICAS, "1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        value = environ.get(name, default)
        if not value.isdigit():
            raise ValueError(f"{name}={value!r} is not a non-negative integer")
        numbers[name] = int(value)
    config = ManagerConfig(
        replica_id=environ[ENV_REPLICA_ID],
        lighthouse=parse_address(environ[ENV_LIGHTHOUSE]),
        min_replica_size=numbers[ENV_MIN_REPLICAS],
        timeout=timeout,
        quorum_timeout=timeout,
        # torchrun runs one replica group: its RANK / WORLD_SIZE are the rank in the group.
        group_rank=numbers["RANK"],
        group_world_size=numbers["WORLD_SIZE"],
        bind_host=environ.get(ENV_BIND_HOST) or "127.0.0.1",
        secret=read_secret(environ),
    )
    if environ.get(ENV_HOSTNAME):
        config = dataclasses.replace(config, hostname=environ[ENV_HOSTNAME])
    return config


def fault_tolerance_config_from_env(
    environ: Mapping[str, str], *, timeout: datetime.timedelta = datetime.timedelta(seconds=60)
) -> ManagerConfig | TorchftConfig:
    """The engine the environment names: recopt's lighthouse if ``RECOPT_FT_LIGHTHOUSE`` is
    set (`manager_config_from_env`), else torchft (`torchft_config_from_env`).

    Raises:
        ImportError: torchft is needed and not installed (names the extra ``recopt[ft]``).
        ValueError: a variable is missing or malformed (the message names it).
    """
    if environ.get(ENV_LIGHTHOUSE):
        return manager_config_from_env(environ, timeout=timeout)
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
    config: ManagerConfig | TorchftConfig,
    *,
    wait_for: int = 1,
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
        config: this replica group's manager settings: a `TorchftConfig` runs on torchft
            (`TorchftManager`), a `ManagerConfig` on recopt's own lighthouse.
        wait_for: before returning, wait (up to ``config.quorum_timeout``) until this many
            replica groups are live, so the first quorum has them all (recopt's lighthouse;
            torchft's lighthouse waits for its ``--min_replicas`` itself).
        sync_embeddings: keep fused tables identical across replica groups
            (`EmbeddingReplicaSync`, needs kernels with ``grad_hook``); False lets each
            replica group train its own tables (healing still copies them).
        extra_state: name -> object with ``state_dict``/``load_state_dict``, healed too.

    Returns:
        The manager, the optimizer to use in the loop, and the guards.

    Raises:
        ValueError: ``sync_embeddings`` with a kernel that cannot take part (no hook), or
            with id-mapped tables it cannot keep equal (``init_fn``; a sharded collection).
        ImportError: a `TorchftConfig` without torchft installed (names the extra).
    """
    extras = dict(extra_state or {})
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):
        init_state()  # strict in-place loaders need the lazily created state on both sides

    state_dict, load_state_dict = _healing_state(model, optimizer, extras)
    manager: StepTransaction
    if isinstance(config, TorchftConfig):
        manager = TorchftManager(config, state_dict=state_dict, load_state_dict=load_state_dict)
    else:
        manager = Manager(config, state_dict=state_dict, load_state_dict=load_state_dict)
    guards, syncs = [], []
    try:
        for module in _fused_collections(model):
            guards.append(FusedEmbeddingGuard(module, manager))
            if sync_embeddings:
                syncs.append(EmbeddingReplicaSync(module, manager, guards[-1]))
    except ValueError:
        manager.shutdown()
        raise
    if wait_for > 1 and isinstance(config, ManagerConfig):
        live = wait_for_replicas(config.lighthouse, wait_for, config.quorum_timeout, config.secret)
        logger.info("replica %s: %d replica groups live: %s", config.replica_id, len(live), live)
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
