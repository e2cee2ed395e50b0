"""recopt's fault-tolerant step on torchft: its quorum, Rust lighthouse and gloo process group.

`TorchftManager` drives a ``torchft.Manager`` (synchronous quorum, healing through recopt's
`TensorTransport`) and adds what recommendation models need on top (`StepTransaction`): the
averaged dense gradients with the non-finite vote, the row all-gathers of the fused-table
layer, and the participants that roll fused tables back when a step is dropped. torchft is
the optional extra ``recopt[ft]``; `require_torchft` says so when it is missing.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from recopt.ft.steps import StepTransaction

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def require_torchft(what: str = "fault tolerance") -> None:
    """Raise if torchft is not installed.

    Raises:
        ImportError: naming the extra that installs it.
    """
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            f"{what} runs on torchft, which is not installed; install the extra with "
            "`pip install 'recopt[ft]'` (torchft==0.2.0)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TorchftConfig:
    """How one process of a replica group joins a torchft job.

    Args:
        replica_id: this replica group's name (torchft appends a fresh UUID per start).
        lighthouse_addr: the torchft lighthouse, e.g. ``http://node0:29510``.
        store_addr: host of this replica group's TCPStore (torchrun's ``MASTER_ADDR``);
            peers rendezvous on the quorum leader's store, so it must be reachable.
        store_port: its port (torchrun's ``MASTER_PORT``); 0 for a one-process group run
            without torchrun: the manager starts the group's store itself, on a free port.
        group_rank: this process's rank in its replica group; rank r averages with rank r
            of the other groups.
        group_world_size: ranks in the replica group.
        min_replica_size: a step commits only with at least this many replica groups.
        timeout: limit of every collective, vote and healing transfer.
        quorum_timeout: limit for forming a quorum (a lighthouse outage shorter than this
            only delays the step).
        connect_timeout: limit for reaching the lighthouse and the group's manager server.
        init_sync: at step 0, fresh replica groups copy one replica's state.
        hostname: the name peers reach this process by (manager server, healing server).
        bind_host: interface the healing server listens on.
    """

    replica_id: str
    lighthouse_addr: str
    store_addr: str
    store_port: int
    group_rank: int = 0
    group_world_size: int = 1
    min_replica_size: int = 1
    timeout: datetime.timedelta = datetime.timedelta(seconds=30)
    quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    connect_timeout: datetime.timedelta = datetime.timedelta(seconds=10)
    init_sync: bool = True
    hostname: str = LOOPBACK
    bind_host: str = LOOPBACK

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id is empty; give each replica group a unique name")
        if not self.lighthouse_addr.startswith(("http://", "https://")):
            raise ValueError(
                f"lighthouse_addr={self.lighthouse_addr!r} is not a URL; torchft's "
                "lighthouse is reached as http://host:port (torchft_lighthouse --bind)"
            )
        if self.min_replica_size < 1:
            raise ValueError(f"min_replica_size={self.min_replica_size} must be at least 1")
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(
                f"group_rank={self.group_rank} is not in [0, group_world_size="
                f"{self.group_world_size}); pass the rank inside the replica group and its size"
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            if getattr(self, name).total_seconds() <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's variable: http://host:port of the lighthouse
ENV_REPLICA_ID = "REPLICA_GROUP_ID"  # this replica group's name (RECOPT_FT_REPLICA_ID also read)


def torchft_config_from_env(
    environ: Mapping[str, str], *, timeout: datetime.timedelta = datetime.timedelta(seconds=60)
) -> TorchftConfig:
    """Settings of one process of a replica group run by torchrun, from its environment.

    Reads ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` (or ``RECOPT_FT_REPLICA_ID``),
    torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` (the group's TCPStore), ``RANK`` /
    ``WORLD_SIZE`` (torchrun runs one replica group), ``RECOPT_FT_MIN_REPLICAS``,
    ``RECOPT_FT_HOSTNAME`` and ``RECOPT_FT_BIND_HOST`` (default loopback).

    Raises:
        ImportError: torchft is not installed (names the extra).
        ValueError: a variable is missing or malformed (the message names it).
    """
    require_torchft("--fault-tolerant")
    replica_id = environ.get(ENV_REPLICA_ID) or environ.get("RECOPT_FT_REPLICA_ID", "")
    for name, value in (
        (ENV_LIGHTHOUSE, environ.get(ENV_LIGHTHOUSE)),
        (ENV_REPLICA_ID, replica_id),
    ):
        if not value:
            raise ValueError(
                f"{name} is not set; --fault-tolerant needs {ENV_LIGHTHOUSE}=http://host:port "
                f"(from `torchft_lighthouse --min_replicas N`) and a unique {ENV_REPLICA_ID} "
                "per replica group (docs/fault_tolerance.md)"
            )
    numbers = {}
    defaults = (("RECOPT_FT_MIN_REPLICAS", "1"), ("RANK", "0"), ("WORLD_SIZE", "1"))
    # Without torchrun (no MASTER_PORT) a one-process group starts its own store (port 0).
    lone = environ.get("WORLD_SIZE", "1") == "1" and "MASTER_PORT" not in environ
    for name, default in (*defaults, ("MASTER_PORT", "0" if lone else "")):
        value = environ.get(name, default)
        if not value.isdigit():
            raise ValueError(
                f"{name}={value!r} is not a non-negative integer"
                + ("; run each replica group under torchrun" if name == "MASTER_PORT" else "")
            )
        numbers[name] = int(value)
    bind_host = environ.get("RECOPT_FT_BIND_HOST") or LOOPBACK
    return TorchftConfig(
        replica_id=replica_id,
        lighthouse_addr=environ[ENV_LIGHTHOUSE],
        store_addr=environ.get("MASTER_ADDR") or LOOPBACK,
        store_port=numbers["MASTER_PORT"],
        group_rank=numbers["RANK"],
        group_world_size=numbers["WORLD_SIZE"],
        min_replica_size=numbers["RECOPT_FT_MIN_REPLICAS"],
        timeout=timeout,
        quorum_timeout=timeout,
        hostname=environ.get("RECOPT_FT_HOSTNAME") or bind_host,
        bind_host=bind_host,
    )


# torchft 0.2.0's Manager keeps the future of the last quorum in this private attribute.
QUORUM_FUTURE = "_quorum_future"


def forget_failed_quorum(engine: Any) -> None:
    """Make the next ``start_quorum`` ask the lighthouse afresh after a failed quorum.

    torchft 0.2.0's ``Manager.start_quorum`` first waits on the previous quorum's future, so
    a quorum that failed (the lighthouse down longer than ``quorum_timeout``) would raise
    again at every later step and the replica group could never recover. Its public API has
    no reset (``start_quorum``, ``wait_quorum`` and ``should_commit`` all re-raise it), so
    the private attribute is cleared; tests/test_ft_torchft_api.py fails if a torchft
    upgrade renames it.

    Raises:
        AttributeError: ``engine`` has no such attribute (torchft changed: see above).
    """
    if not hasattr(engine, QUORUM_FUTURE):
        raise AttributeError(
            f"torchft's Manager has no {QUORUM_FUTURE!r}; recopt clears it after a failed "
            "quorum (torchft 0.2.0 re-raises it at every later step): check the installed "
            "torchft against recopt[ft]'s pin, torchft==0.2.0"
        )
    setattr(engine, QUORUM_FUTURE, None)


class TorchftManager(StepTransaction):
    """One replica group's process on a torchft job; the step is that of `StepTransaction`.

    Args:
        config: identity, addresses and limits.
        state_dict: returns this process's full training state, sent to a healing peer.
        load_state_dict: loads such a state when this process heals.

    Raises:
        ImportError: torchft is not installed (the message names the extra).
    """

    def __init__(
        self,
        config: TorchftConfig,
        *,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        require_torchft()
        from torchft.manager import Manager as TorchftEngine
        from torchft.process_group import ProcessGroupGloo

        from recopt.ft.tensor_transport import TensorTransport

        super().__init__(config.replica_id, config.min_replica_size, config.timeout)
        self.config = config
        self._quorum_failed = False
        self._pg = ProcessGroupGloo(timeout=config.timeout)
        self._store = _own_store(config)
        store_port = self._store.port if self._store is not None else config.store_port
        self._transport = TensorTransport(config.timeout, config.bind_host, config.hostname)
        try:
            self._ft = TorchftEngine(
                pg=self._pg,
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=config.min_replica_size,
                use_async_quorum=False,  # heal before the forward pass, as recopt's layer needs
                timeout=config.timeout,
                quorum_timeout=config.quorum_timeout,
                connect_timeout=config.connect_timeout,
                rank=config.group_rank,
                world_size=config.group_world_size,
                store_addr=config.store_addr,
                store_port=store_port,
                lighthouse_addr=config.lighthouse_addr,
                replica_id=config.replica_id,
                hostname=config.hostname,
                checkpoint_transport=self._transport,
                init_sync=config.init_sync,
            )
        except BaseException:
            self._transport.shutdown()
            raise

    def current_step(self) -> int:
        """Number of committed steps (restored from the source when healing)."""
        return int(self._ft.current_step())

    def batches_committed(self) -> int:
        """Sum over committed steps of the number of participants (replica batches)."""
        return int(self._ft.batches_committed())

    def start_quorum(self) -> None:
        """Join the step's quorum through torchft, healing first if this group is behind.

        Never raises for distributed failures (a lighthouse outage longer than
        ``quorum_timeout`` included): they mark the step errored.
        """
        self._errored = None
        self._num_participants = 0
        self._quorum_failed = False
        try:
            self._ft.start_quorum()
            self._num_participants = int(self._ft.num_participants())
            self._rank = int(self._ft.participating_rank() or 0)
        except Exception as exc:  # noqa: BLE001 - an unreachable quorum only drops the step
            self._quorum_failed = True
            forget_failed_quorum(self._ft)
            self.report_error(exc)
        failure = self._ft.errored()
        if failure is not None:
            self.report_error(failure.original_exception)
        self._begin()

    def report_error(self, exc: Exception) -> None:
        """Mark the step errored here and in torchft (the whole group then votes no)."""
        super().report_error(exc)
        if not self._quorum_failed and self._ft.errored() is None:
            self._ft.report_error(exc)

    def _vote(self, ok: bool) -> bool:
        if self._quorum_failed:
            return False
        if not ok and self._ft.errored() is None:
            self._ft.report_error(RuntimeError("fewer participants than min_replica_size"))
        try:
            return bool(self._ft.should_commit()) and ok
        except Exception as exc:  # noqa: BLE001 - no answer is a no
            self.report_error(exc)
            return False

    def shutdown(self) -> None:
        """Leave the job: stop the manager server and the healing server."""
        self._ft.shutdown(wait=False)


def _own_store(config: TorchftConfig) -> dist.TCPStore | None:
    """The group's TCPStore, started here when ``store_port`` is 0 (a one-process group run
    without torchrun); None when torchrun's store is used.

    Raises:
        ValueError: port 0 for a group of more than one process (they need torchrun's store).
    """
    if config.store_port != 0:
        return None
    if config.group_world_size != 1:
        raise ValueError(
            f"store_port 0 (start the store here) needs a one-process replica group, got "
            f"group_world_size {config.group_world_size}; run the group under torchrun"
        )
    return dist.TCPStore(
        config.store_addr, 0, is_master=True, wait_for_workers=False, timeout=config.timeout
    )
