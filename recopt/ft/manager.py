"""The Manager: one per replica group, it makes every training step a quorum-wide transaction.

Each step it asks the lighthouse for a quorum, heals itself from a peer if it is behind,
rebuilds the cross-replica gloo group when the membership changed, averages gradients over
the participants, and commits only if every participant votes yes. A failure or timeout
anywhere marks the step errored: the step is dropped, never half-applied. So does a NaN/inf
gradient on any replica (`NonFiniteGradientError`): every replica sees it after the exchange.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recopt.ft.auth import LOOPBACK, check_bind
from recopt.ft.client import request
from recopt.ft.healing import CheckpointServer, fetch_checkpoint, plan_recovery
from recopt.ft.heartbeat import Heartbeat
from recopt.ft.steps import StepTransaction

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ManagerConfig:
    """How a replica group reaches the lighthouse, and its limits.

    Args:
        replica_id: unique name of this replica group (stable across its restarts).
        lighthouse: the lighthouse's (host, port).
        min_replica_size: a step commits only with at least this many participants.
        timeout: limit for each collective, vote and healing transfer.
        quorum_timeout: limit for forming a quorum (covers peers still starting up).
        heartbeat_interval: how often the lighthouse hears this replica is alive.
        init_sync: at step 0, fresh replicas copy the first replica's state.
        hostname: name peers use to reach this replica's checkpoint server (loopback by
            default; on several hosts, a name the other hosts resolve to ``bind_host``).
        bind_host: interface the checkpoint server listens on (loopback by default; another
            one needs a ``secret``).
        secret: the job's shared secret, signing every lighthouse request and healing
            transfer (the same on every replica and the lighthouse); None: unauthenticated,
            allowed only on loopback.
        group_rank: this process's rank inside its replica group (a sharded replica group
            runs one Manager per rank; rank r averages with rank r of the other groups).
        group_world_size: number of ranks in the replica group.
    """

    replica_id: str
    lighthouse: tuple[str, int]
    min_replica_size: int = 1
    timeout: datetime.timedelta = datetime.timedelta(seconds=30)
    quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    heartbeat_interval: datetime.timedelta = datetime.timedelta(milliseconds=200)
    init_sync: bool = True
    hostname: str = LOOPBACK
    group_rank: int = 0
    group_world_size: int = 1
    bind_host: str = LOOPBACK
    secret: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id is empty; give each replica group a unique name")
        if self.min_replica_size < 1:
            raise ValueError(f"min_replica_size={self.min_replica_size} must be at least 1")
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(
                f"group_rank={self.group_rank} is not in [0, group_world_size="
                f"{self.group_world_size}); pass the rank inside the replica group (LOCAL_RANK "
                "or RANK of the group's torchrun) and its size"
            )
        for name in ("timeout", "quorum_timeout", "heartbeat_interval"):
            if getattr(self, name).total_seconds() <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        check_bind(self.bind_host, self.secret, f"replica {self.replica_id!r}'s state server")


class Manager(StepTransaction):
    """Coordinates one replica group with its peers; see the module docstring for a step.

    Args:
        config: identity, lighthouse address and limits.
        state_dict: returns this replica's full training state (model, optimizer, ...),
            sent to a peer that heals from it.
        load_state_dict: loads such a state when this replica heals.
    """

    def __init__(
        self,
        config: ManagerConfig,
        *,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        super().__init__(config.replica_id, config.min_replica_size, config.timeout)
        self.config = config
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self._step = 0
        self._batches_committed = 0
        self._first = True
        self._round: int | None = None
        self._quorum_id: str | None = None  # "<lighthouse epoch>/<quorum id>"
        self._store: dist.TCPStore | None = None
        self._server = CheckpointServer(config.bind_host, config.timeout, config.secret)
        self._heartbeat = Heartbeat(config)
        # Known to the lighthouse from now on, so that a quorum forming while this replica
        # starts up waits for it rather than leaving it for the next round.
        try:
            self._heartbeat.start()
        except BaseException:
            self._server.stop()
            raise

    # -- counters ---------------------------------------------------------------------------
    def current_step(self) -> int:
        """Number of committed steps (restored from the source when healing)."""
        return self._step

    def batches_committed(self) -> int:
        """Sum over committed steps of the number of participants (replica batches)."""
        return self._batches_committed

    # -- the step -----------------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Begin a step: join the quorum, heal if behind, (re)build the gloo group.

        Never raises for distributed failures: they mark the step errored instead.
        """
        self._errored = None
        self._round = None
        self._num_participants = 0
        member = {
            "replica_id": self.config.replica_id,
            "step": self._step,
            "first": self._first,
            "errored": self._pg_broken,
            "group_rank": self.config.group_rank,
            "group_world_size": self.config.group_world_size,
            "address": f"http://{self.config.hostname}:{self._server.port}",
            "session": self._heartbeat.session,
        }
        try:
            reply = request(
                self.config.lighthouse,
                {"op": "quorum", "member": member},
                self.config.quorum_timeout,
                self.config.secret,
            )
            self._apply_quorum(reply)
        except Exception as exc:  # noqa: BLE001 - any failure here only drops the step
            self.report_error(exc)
        self._begin()

    def _apply_quorum(self, reply: dict[str, Any]) -> None:
        members: list[dict[str, Any]] = reply["members"]
        names = [str(m["replica_id"]) for m in members]
        if self.config.replica_id not in names:
            raise RuntimeError(
                f"replica group {self.config.replica_id!r} was left out of round "
                f"{reply['round']} (not all of its ranks joined in time)"
            )
        self._round = int(reply["round"])
        self._rank = names.index(self.config.replica_id)
        self._num_participants = len(members)
        recovery = plan_recovery(members, self.config.init_sync)
        by_name = {str(m["replica_id"]): m for m in members}
        if self.config.replica_id in recovery.values():
            size = self._server.publish(self._step, self._full_state())
            logger.info(
                "replica %s: serving step %d (%d bytes)", self.config.replica_id, self._step, size
            )
        source = recovery.get(self.config.replica_id)
        if source is not None:
            self._heal(by_name[source])
        self._first = False
        quorum_id = f"{reply['epoch']}/{reply['quorum_id']}"
        if len(members) == 1:
            self._pg, self._pg_broken = None, False  # alone: nothing to reduce with
        elif quorum_id != self._quorum_id or self._pg is None:
            self._pg = None
            self._quorum_id = None
            self._connect(int(reply["store_port"]), quorum_id)
        self._quorum_id = quorum_id

    def _full_state(self) -> dict[str, Any]:
        return {
            "user": self._state_dict(),
            "step": self._step,
            "batches_committed": self._batches_committed,
        }

    def _heal(self, source: dict[str, Any]) -> None:
        start = time.monotonic()
        address = source["addresses"][self.config.group_rank]
        url = f"{address}/checkpoint/{int(source['step'])}"
        state = fetch_checkpoint(url, self.config.timeout, self.config.secret)
        self._load_state_dict(state["user"])
        self._step = int(state["step"])
        self._batches_committed = int(state["batches_committed"])
        logger.info(
            "replica %s healed from %s to step %d in %.3f s",
            self.config.replica_id,
            source["replica_id"],
            self._step,
            time.monotonic() - start,
        )

    def _connect(self, store_port: int, quorum_id: str) -> None:
        self._pg_broken = True  # until the rendezvous below has succeeded
        if self._store is None or self._store.port != store_port:
            self._store = dist.TCPStore(
                self.config.lighthouse[0],
                store_port,
                is_master=False,
                wait_for_workers=False,
                timeout=self.config.timeout,
            )
        lane = self.config.group_rank  # rank r of every group: one gloo group per lane
        store = dist.PrefixStore(f"recopt-ft/{quorum_id}/lane{lane}", self._store)
        try:
            self._pg = dist.ProcessGroupGloo(
                store, self._rank, self._num_participants, self.config.timeout
            )
        except Exception:
            self._store = None  # reconnect next time: the store itself may be what failed
            raise
        self._pg_broken = False

    # -- the vote -----------------------------------------------------------------------------
    def _vote(self, ok: bool) -> bool:
        """Send this replica's vote to the lighthouse; a step commits only if all voted yes."""
        if self._round is None:
            return False
        payload = {
            "op": "vote",
            "round": self._round,
            "replica_id": self.config.replica_id,
            "group_rank": self.config.group_rank,
            "ok": ok,
        }
        try:
            config = self.config
            reply = request(config.lighthouse, payload, config.timeout, config.secret)
            return bool(reply["commit"]) and ok
        except Exception as exc:  # noqa: BLE001 - no answer is a no
            self.report_error(exc)
            return False

    def _on_commit(self) -> None:
        self._step += 1
        self._batches_committed += self._num_participants

    # -- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop heartbeating and serving; the lighthouse will see this replica leave."""
        self._heartbeat.stop()
        self._server.stop()
        self._pg = None
