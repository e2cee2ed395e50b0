"""The lighthouse: the small coordinator that forms a quorum of replica groups at every step.

Replica groups heartbeat to it, ask it for the step's quorum (who participates, at which
step, under which quorum id) and send it their commit vote; it also hosts the TCPStore on
which each quorum's cross-replica gloo group meets. Run it with
``python -m recopt.ft.lighthouse --port P --min-replicas K``. The protocol is one JSON line
per request and one per reply, over a short-lived TCP connection, each signed with the job's
shared secret (`recopt.ft.auth`); it listens on loopback unless given another host.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socketserver
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from recopt.ft.auth import LOOPBACK, AuthError, Verifier, check_bind, read_secret
from recopt.ft.client import LIGHTHOUSE_CONTEXT, envelope, open_envelope

logger = logging.getLogger(__name__)

# How often a waiting request re-checks whether its quorum can form or its vote is decided:
# formation also depends on the clock (join timeout, expired heartbeats), not only on joins.
_TICK_S = 0.02
# Decided rounds kept for late voters (a replica that hung and wakes up asks afterwards).
_ROUNDS_KEPT = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class LighthouseConfig:
    """When the lighthouse forms a quorum and when it declares a replica dead.

    Args:
        min_replicas: a quorum forms only with at least this many replica groups.
        join_timeout: once ``min_replicas`` have joined, how long to wait for the other live
            replicas (those still heartbeating) before forming the quorum without them.
        heartbeat_timeout: a replica silent for this long is dead: no quorum waits for it and
            a vote it has not cast is a no.
    """

    min_replicas: int = 1
    join_timeout: datetime.timedelta = datetime.timedelta(seconds=5)
    heartbeat_timeout: datetime.timedelta = datetime.timedelta(seconds=2)

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas={self.min_replicas} must be at least 1")
        if self.join_timeout.total_seconds() < 0:
            raise ValueError(f"join_timeout={self.join_timeout} must be >= 0 (0: never wait)")
        if self.heartbeat_timeout.total_seconds() <= 0:
            raise ValueError(f"heartbeat_timeout={self.heartbeat_timeout} must be positive")


class DuplicateReplicaError(ValueError):
    """Two live processes claim the same replica id and rank."""

    def __init__(self, message: str, expires_in_s: float) -> None:
        super().__init__(message)
        self.expires_in_s = expires_in_s


@dataclass(slots=True)
class _Round:
    quorum: dict[str, Any]
    votes: dict[str, bool] = field(default_factory=dict)
    decision: bool | None = None


class QuorumState:
    """The lighthouse's bookkeeping, without sockets or threads (callers pass the clock).

    A quorum is formed per *round* over replica groups: the ranks of each group join the open
    round (a group of ``group_world_size`` ranks counts once all its ranks have joined); the
    round closes when at least ``min_replicas`` groups are complete and either every live
    group is complete or the join timeout has run out. The quorum id changes whenever the
    membership changes or a member reports that its last collective failed, so that members
    rebuild their process groups.
    """

    def __init__(self, config: LighthouseConfig) -> None:
        self.config = config
        self._heartbeats: dict[tuple[str, int], float] = {}  # (group, rank) -> last seen
        self._pending: dict[str, dict[int, dict[str, Any]]] = {}  # group -> rank -> member
        self._first_join: float | None = None
        self._round = 0
        self._quorum_id = 0
        self._last_members: list[str] = []
        self._rounds: dict[int, _Round] = {}
        self._sessions: dict[tuple[str, int], str] = {}  # (group, rank) -> its process's id

    def heartbeat(
        self, replica_id: str, now: float, group_rank: int = 0, session: str | None = None
    ) -> None:
        """Record that a rank of a replica group is alive at ``now``.

        Args:
            session: a random id of the sending process (each Manager has its own); None
                skips the duplicate check.

        Raises:
            DuplicateReplicaError: another live process already uses this replica id and
                rank (two replica groups were given the same id).
        """
        key = (replica_id, group_rank)
        if session is not None:
            other = self._sessions.get(key)
            last = self._heartbeats.get(key)
            limit = self.config.heartbeat_timeout.total_seconds()
            if other is not None and other != session and last is not None and now - last <= limit:
                raise DuplicateReplicaError(
                    f"replica id {replica_id!r} (rank {group_rank}) is already used by another "
                    f"live process (heard {now - last:.1f} s ago); give every replica group a "
                    f"unique replica id (RECOPT_FT_REPLICA_ID). A restarted replica is let in "
                    f"once its predecessor has been silent for {limit:g} s",
                    expires_in_s=limit - (now - last),
                )
            self._sessions[key] = session
        self._heartbeats[key] = now

    def live(self, now: float) -> set[str]:
        """Groups whose every known rank heartbeated recently.

        One dead rank breaks its group: no quorum waits for it, and its missing votes are noes.
        """
        limit = self.config.heartbeat_timeout.total_seconds()
        groups = {g for g, _ in self._heartbeats}
        dead = {g for (g, _), t in self._heartbeats.items() if now - t > limit}
        return groups - dead

    def join(self, member: dict[str, Any], now: float) -> int:
        """Add a replica rank to the open round; returns the round it gets its quorum from."""
        replica_id, rank = str(member["replica_id"]), int(member.get("group_rank", 0))
        self.heartbeat(replica_id, now, rank, member.get("session"))
        if not self._pending:
            self._first_join = now
        self._pending.setdefault(replica_id, {})[rank] = member
        return self._round

    def _complete(self) -> list[str]:
        return sorted(
            r
            for r, ranks in self._pending.items()
            if len(ranks) == int(next(iter(ranks.values())).get("group_world_size", 1))
        )

    def try_form(self, now: float) -> bool:
        """Close the open round if its quorum can form now; returns whether it did."""
        complete = self._complete()
        if len(complete) < self.config.min_replicas:
            return False
        assert self._first_join is not None
        waited = now - self._first_join
        stragglers = self.live(now) - set(complete)
        if stragglers and waited < self.config.join_timeout.total_seconds():
            return False
        members = [_group_member(self._pending[r]) for r in complete]
        if complete != self._last_members or any(m["errored"] for m in members):
            self._quorum_id += 1
        self._last_members = complete
        quorum = {"round": self._round, "quorum_id": self._quorum_id, "members": members}
        self._rounds[self._round] = _Round(quorum=quorum)
        self._rounds.pop(self._round - _ROUNDS_KEPT, None)
        logger.info(
            "round %d: quorum %d with %s (left out: %s)",
            self._round,
            self._quorum_id,
            complete,
            sorted(stragglers),
        )
        self._round += 1
        self._pending = {}
        self._first_join = None
        return True

    def leave(self, replica_id: str, group_rank: int, round_no: int) -> None:
        """Withdraw a rank that stopped waiting, so no quorum counts on its group."""
        if round_no == self._round and replica_id in self._pending:
            self._pending[replica_id].pop(group_rank, None)
            if not self._pending[replica_id]:
                del self._pending[replica_id]
            if not self._pending:
                self._first_join = None

    def quorum(self, round_no: int) -> dict[str, Any] | None:
        """The quorum a round formed, or None while it is open (or forgotten)."""
        entry = self._rounds.get(round_no)
        return None if entry is None else entry.quorum

    def vote(self, round_no: int, replica_id: str, group_rank: int, ok: bool, now: float) -> None:
        """Record a rank's vote; an unknown (forgotten) round counts as already refused."""
        self.heartbeat(replica_id, now, group_rank)
        entry = self._rounds.get(round_no)
        if entry is not None and entry.decision is None:
            entry.votes[f"{replica_id}/{group_rank}"] = ok

    def decision(self, round_no: int, now: float) -> bool | None:
        """Commit (True), refuse (False) or undecided (None) for a round; final once decided.

        Refused as soon as one rank votes no or its group dies before all voted, so that
        survivors of a crash do not wait for a vote that will never come.
        """
        entry = self._rounds.get(round_no)
        if entry is None:
            return False
        if entry.decision is None:
            voters = [
                (str(m["replica_id"]), f"{m['replica_id']}/{rank}")
                for m in entry.quorum["members"]
                for rank in range(int(m["group_world_size"]))
            ]
            live = self.live(now)
            if any(entry.votes.get(v) is False for _, v in voters):
                entry.decision = False
            elif any(v not in entry.votes and g not in live for g, v in voters):
                entry.decision = False
            elif all(v in entry.votes for _, v in voters):
                entry.decision = True
        return entry.decision

    def expire(self, round_no: int) -> None:
        """Refuse a round nobody decided in time (a voter's own timeout ran out)."""
        entry = self._rounds.get(round_no)
        if entry is not None and entry.decision is None:
            entry.decision = False


def _group_member(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One quorum member from its ranks' requests: every rank's address, in rank order."""
    first = ranks[0]
    return {
        "replica_id": first["replica_id"],
        "group_world_size": len(ranks),
        "step": min(int(m["step"]) for m in ranks.values()),
        "first": any(m.get("first") for m in ranks.values()),
        "errored": any(m.get("errored") for m in ranks.values()),
        "addresses": [ranks[r].get("address") for r in sorted(ranks)],
    }


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.connection.settimeout(self.server.io_timeout_s)
        nonce: str | None = None
        try:
            line = self.rfile.readline()
            try:
                request, nonce = open_envelope(line, self.server.verifier, LIGHTHOUSE_CONTEXT)
            except AuthError as exc:
                logger.warning("refused a request from %s: %s", self.client_address[0], exc)
                raise
            reply = self.server.dispatch(request)
        except Exception as exc:  # noqa: BLE001 - any bad request gets an error reply
            reply = {"error": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, DuplicateReplicaError):
                reply["expires_in_s"] = exc.expires_in_s
        try:
            secret = self.server.verifier.secret
            self.wfile.write(envelope(secret, f"reply {nonce or ''}", reply))
        except OSError:
            pass  # the client gave up (its own timeout); nothing to tell it


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], lighthouse: Lighthouse, secret: bytes | None
    ) -> None:
        self.lighthouse = lighthouse
        self.verifier = Verifier(secret)
        self.io_timeout_s = 30.0
        super().__init__(address, _Handler)

    def dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.lighthouse.handle(request)


class Lighthouse:
    """The coordinator service: a threaded TCP server around a `QuorumState`, plus a TCPStore.

    Args:
        config: quorum and liveness rules.
        host: interface to listen on; loopback by default (one machine). Another interface
            (``0.0.0.0`` for all) needs a ``secret``.
        port: TCP port; 0 picks a free one (read it back from ``address``).
        secret: the job's shared secret: every request must be signed with it (and every
            reply is). None: no authentication, allowed only on loopback.

    Raises:
        ValueError: a non-loopback ``host`` without a ``secret``.
    """

    def __init__(
        self,
        config: LighthouseConfig,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        secret: bytes | None = None,
    ) -> None:
        check_bind(host, secret, "the lighthouse")
        self.config = config
        self._state = QuorumState(config)
        self._cond = threading.Condition()
        self._server = _Server((host, port), self, secret)
        # Each quorum's gloo group meets under a fresh prefix of this store.
        self.store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self._thread: threading.Thread | None = None
        # Quorum ids restart with the process: the epoch tells replicas a new lighthouse's
        # quorum 3 from the old one's, so they rebuild their group.
        self._epoch = uuid.uuid4().hex[:12]

    @property
    def port(self) -> int:
        """The TCP port the lighthouse listens on."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Serve in a background daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        """Serve in the calling thread until `shutdown`."""
        self._server.serve_forever(poll_interval=0.1)

    def shutdown(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one decoded request (``heartbeat``, ``quorum``, ``vote`` or ``status``)."""
        op = request.get("op")
        timeout_s = float(request.get("timeout_s", 30.0))
        if op == "heartbeat":
            with self._cond:
                rank = int(request.get("group_rank", 0))
                session = request.get("session")
                self._state.heartbeat(str(request["replica_id"]), time.monotonic(), rank, session)
            return {"ok": True}
        if op == "quorum":
            return self._wait_quorum(request["member"], timeout_s)
        if op == "vote":
            voter = (str(request["replica_id"]), int(request.get("group_rank", 0)))
            return self._wait_vote(int(request["round"]), voter, bool(request["ok"]), timeout_s)
        if op == "status":
            with self._cond:
                return {"live": sorted(self._state.live(time.monotonic()))}
        raise ValueError(f"unknown op {op!r}; valid: heartbeat, quorum, vote, status")

    def _wait_quorum(self, member: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            round_no = self._state.join(member, time.monotonic())
            while True:
                if self._state.try_form(time.monotonic()):
                    self._cond.notify_all()
                quorum = self._state.quorum(round_no)
                if quorum is not None:
                    return {**quorum, "store_port": self.store.port, "epoch": self._epoch}
                if time.monotonic() >= deadline:
                    rank = int(member.get("group_rank", 0))
                    self._state.leave(str(member["replica_id"]), rank, round_no)
                    return {"error": f"TimeoutError: no quorum within {timeout_s:.1f} s"}
                self._cond.wait(_TICK_S)

    def _wait_vote(
        self, round_no: int, voter: tuple[str, int], ok: bool, timeout_s: float
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._state.vote(round_no, voter[0], voter[1], ok, time.monotonic())
            self._cond.notify_all()
            while True:
                decision = self._state.decision(round_no, time.monotonic())
                if decision is not None:
                    return {"commit": decision}
                if time.monotonic() >= deadline:
                    # Decide for everyone, so no other member can still see a commit.
                    self._state.expire(round_no)
                    return {"commit": False}
                self._cond.wait(_TICK_S)


def _write_port_file(path: str, port: int) -> None:
    # Written then renamed, so a reader never sees a half-written port.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m recopt.ft.lighthouse --port P --min-replicas K``."""
    parser = argparse.ArgumentParser(prog="python -m recopt.ft.lighthouse", description=__doc__)
    parser.add_argument(
        "--host",
        default=LOOPBACK,
        help="interface to listen on (default loopback; another one needs the shared secret "
        "in RECOPT_FT_SECRET or RECOPT_FT_SECRET_FILE)",
    )
    parser.add_argument("--port", type=int, default=29510, help="TCP port (0: any free one)")
    parser.add_argument("--min-replicas", type=int, default=1, help="smallest quorum")
    parser.add_argument("--join-timeout-s", type=float, default=5.0, help="wait for stragglers")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=2.0, help="declare dead")
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    args = parser.parse_args(argv)
    secret = read_secret(os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lighthouse %(message)s")
    config = LighthouseConfig(
        min_replicas=args.min_replicas,
        join_timeout=datetime.timedelta(seconds=args.join_timeout_s),
        heartbeat_timeout=datetime.timedelta(seconds=args.heartbeat_timeout_s),
    )
    lighthouse = Lighthouse(config, host=args.host, port=args.port, secret=secret)
    logger.info(
        "listening on %s:%d (store port %d), %s",
        args.host,
        lighthouse.port,
        lighthouse.store.port,
        "authenticated" if secret is not None else "UNAUTHENTICATED (no shared secret)",
    )
    if args.port_file:
        _write_port_file(args.port_file, lighthouse.port)
    try:
        lighthouse.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    main()
